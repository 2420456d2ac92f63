"""Enforce(): the mode scope and reference-counted installs; torch.compile runs gradguard eagerly."""
