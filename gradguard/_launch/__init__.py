"""Every process that trains: the bootstrap that reaches the processes a command starts, each
process's setup and report, and the one summary ``gradguard run`` prints (issue 18).

``bootstrap/sitecustomize.py``  the folder ``gradguard run`` puts first on ``PYTHONPATH``: arms on torch's import
``_settings``   the environment variables that carry the run's settings to every process
``_identity``   where a process is: rank and world size, host, pid, Ray actor
``_actor``      the Ray actor a worker process runs: its instance (a named root) and class
``_report``     one process's report file: its content, written atomically, read back
``_process``    a reached process's setup: ``enforce()``, the watch, its report, fork and exit
``_merge``      the reports of a run merged into one summary

Nothing here is imported by ``import gradguard``; the bootstrap imports ``_process`` only once torch
is imported.
"""
