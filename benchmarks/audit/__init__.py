"""What ``gradguard.audit()`` costs, against the floor of any Python-level heap scan.

Run from the repository root: ``python -m benchmarks.audit [--json PATH] [--md PATH]``. Two figures,
measured in one run with paired, interleaved rounds:

* *clean*: an audit of a heap that holds no autograd graph, against a bare ``gc.get_objects()``
  plus a ``torch.Tensor`` type filter on the same heap, at 10⁵, 10⁶ and 3·10⁶ live (gc-tracked)
  objects. Target: ≤ 3× (the bare scan is the floor for any Python-level scan).
* *leak*: an audit that finds one list of 100 leaked records (``{"loss", "logits", "step"}`` of a
  small MLP) in a 10⁶-object heap. Target: ≤ 2 s; the number of heap passes the path search made
  is reported (one per level of the path, never one per tensor).
"""
