"""The publish boundary: one record through the mode, and offloading what is stored."""
