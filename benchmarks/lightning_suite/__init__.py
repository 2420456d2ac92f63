"""Lightning's own tests (loops, optimization, LightningOptimizer; the CPU subset) run plain and under
gradguard's pytest options: ``python -m benchmarks.lightning_suite LIGHTNING_CHECKOUT`` (see README.md).

Kept free of imports: ``recorder`` is loaded into the measured pytest process as a plugin.
"""
