"""Who holds a tensor: frames read without side effects, paths, whose state an object is, the holder search."""
