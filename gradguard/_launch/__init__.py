"""Every process that trains: the bootstrap that reaches the processes a command starts, each
process's setup and report, and the one summary ``gradguard run`` prints.

``bootstrap/sitecustomize.py``  the folder ``gradguard run`` puts first on ``PYTHONPATH``: arms on torch's import
``_settings``   the environment variables that carry the run's settings to every process
``commands``    ``gradguard run``, ``env`` and ``report``: their options, checked, and what each does (what
                the CLI calls; the ``_`` modules are this package's own)
``_identity``   where a process is: rank and world size, host, pid (and start time), Ray actor
``_actor``      the Ray actor a worker process runs: its instance (a named root) and class
``_names``      the run folder's file names, which carry the run id
``_report``     one process's report: its typed record, the fields derived from it, written atomically
``_read``       a run folder read back: the run's own reports, each checked field by field into its record
``_process``    a reached process's setup: ``enforce()``, the watch, its report, fork and exit
``_processes``  the processes of a run as the summary names them (exec, idle ones, unreached ones)
``_merge``      the records of a run merged into one summary, the watch's own renderer inside

Nothing here is imported by ``import gradguard``; the bootstrap imports ``_process`` only once torch
is imported, and the launcher (``commands`` and what the summary needs) never imports torch.
"""
