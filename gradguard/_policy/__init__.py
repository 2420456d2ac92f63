"""Policy: modes and GRADGUARD, the call site, per-site stats, message texts and tables."""
