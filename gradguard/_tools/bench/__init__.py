"""``gradguard bench``: per-micro-batch memory growth, unguarded and guarded, side by side."""
