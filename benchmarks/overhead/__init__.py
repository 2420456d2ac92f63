"""Per-call overhead of gradguard against the hand-written alternatives, side by side in one run.

    # the committed run, from the repository root (R=benchmarks/results):
    python -m benchmarks.overhead --rounds 201 --json $R/overhead-cpu.json --md $R/overhead-cpu.md
    python -m benchmarks.overhead --only append     # cases whose name or group contains "append"
    python -m benchmarks.overhead --list            # the case names, nothing built
    python -m benchmarks.overhead --from-json RUN.json --md RUN.md  # re-render a run, measure nothing
    python benchmarks/overhead ...                  # the same, run as a directory

Modules: :mod:`.registry` (what a case is, the groups), :mod:`.cases` (the cases, each group owning
its setup and teardown), :mod:`.timing` (the paired statistic), :mod:`.report` (the JSON document and
the tables read from it), ``__main__`` (the command line).
"""
