"""The tree walk: how each container is taken apart and rebuilt, detach_tree and find_graphs."""
