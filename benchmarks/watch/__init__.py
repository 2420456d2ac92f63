"""The watch under its defaults: when each kind of leak is reported, what ``detach`` does to memory, and
what the watch costs, measured side by side.

``python -m benchmarks.watch [--device cpu|cuda] [--quick] [--json PATH] [--md PATH] [--plot PATH]`` (from
the repository root). Every run is ``gradguard.watch()`` with no argument but the mode (``detach``):
``every="auto"``. torch runs on one thread.

Leaks (each run twice in one process: unwatched, then inside ``watch(mode="detach")``):

* ``late/<scenario>``: ``gradguard bench``'s scenarios (4 micro-batches and ``optimizer.step()`` a step)
  that keep, from step ``--late-start``, each step's backwarded loss with a fresh 128 KiB leaf and its
  gradient (256 KiB a step, object state);
* ``fast/eval-forward``: a step of about half a millisecond (an MLP, 128 wide, batch 64, Adam) that
  keeps, from step ``--fast-start``, an evaluation forward run without ``no_grad`` (its saved activations);
* ``growth-then-leak``: the fast step filling a detached replay buffer (32 KiB a step) until step 300,
  then keeping an evaluation forward from step 400;
* ``short-6`` and ``short-30``: a trainer that adds each loss to ``self.running['epoch_loss']`` (6 steps),
  and one that adds each step's squared error, graph included, to a metric's state (30 steps), from step 1;
* ``micro/seed``: the seed's shape, read per micro-batch: one step of ``--seed-micro-batches`` micro-batches
  (an MLP, 128 wide, 3 layers, batch 64) whose log-probabilities, graph attached, go into
  ``output_lst`` after each backward, cleared before ``optimizer.step()``; its columns count micro-batches,
  not steps (the micro-batch it was reported at, the bytes per micro-batch).

Clean runs (watched and unwatched, the same steps): ``fast/clean`` and ``late/<scenario>`` clean, and
``sawtooth`` (the fast step filling a detached buffer for 50 steps, then clearing it).

Figures: the boundary each leak was reported at; the bytes in use after each step (glibc's in-use bytes
on CPU, CUDA's allocated bytes), unwatched and under ``detach``; for clean runs the watch's share of the
wall time after the start-up check, microseconds per backward's root stamp and per boundary, and of
memory reading per boundary (the watch's own account: its governor's; a reading is due by time, within
its share of the wall time, so on a long step at every boundary), heap searches per 1000 steps, and the
wall time against the unwatched run.

The cost, side by side (``--rounds`` pairs of an unwatched and a watched run, alternating which goes
first, CPU time and wall time; the ratio of the median pair, each pair's beside it):

* ``cost/clean-0.5ms``: the fast step, ``--cost-steps`` steps; target 1.02x;
* ``cost/clean-4mb``: a step of 4 micro-batches of ``--mb-scenario`` (``lora-checkpoint``: tens of
  milliseconds on a CPU core), ``--mb-steps`` steps; target 1.003x;
* ``cost/clean-64mb``: gradient accumulation, 64 micro-batches of 0.5 to 2 ms a step (``micro/seed``'s MLP,
  each ``loss.item()`` kept, no record), ``--micro-steps`` steps: every backward is a micro-batch boundary
  of the watch; target 1.02x;
* storms, correct programs whose steps' graphs outlive the step, ``--storm-steps`` fast steps each,
  target 1.05x: ``storm/kept-exception`` (a caught exception kept in a local: the traceback's cycle
  holds the step's output until the collector runs), ``storm/cycles`` (each step's output in a
  reference cycle), ``storm/gc-off`` (the cycles with the collector disabled and ``gc.collect()`` every
  50 steps), ``storm/grad-fn-kept`` (each step's ``loss.grad_fn`` in a list: nodes no tensor holds);
* ``library-leak/<steps>``: a package installed in a folder on ``sys.path`` whose metric accumulates
  each step's error with its graph, which the watch cannot repair (a library's state): target 1.05x at
  each of ``--library-steps`` (200 and 800), and the same ratio at both (its cost does not grow with
  the run).

Last, the floor of the hot path: one root's stamp, making the step's stamp once, and the boundary's
barest signals, timed inside the fast step, unwatched; and the least one search of the heap costs.
"""

__all__ = ["main"]


def main(argv: "list[str] | None" = None) -> int:
    """``python -m benchmarks.watch``'s entry point (see :mod:`benchmarks.watch.__main__`)."""
    from .__main__ import main as run

    return run(argv)
