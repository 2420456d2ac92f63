"""Whether an autograd graph can still be backwarded, and which leaves it reaches.

A node is **dead** when running it in a backward must fail: a tensor it saved was freed by an earlier
backward (one without ``retain_graph``), or was modified in place since it was saved (an optimizer
step updates parameters in place). torch refuses both when the saved tensor is unpacked; a custom
``autograd.Function`` refuses to give its saved tensors once a backward freed them.

A backward from a tensor runs every node on every path from the tensor's node to the tensors it
differentiates for (its *targets*): the leaves that require grad (``.backward()``, or ``inputs=``
naming leaves), or other tensors the program holds (``torch.autograd.grad(out, inputs=[h])``,
which stops at ``h``'s node). So a target is reachable by a backward that can succeed only when no
dead node lies on any path to it. A graph is **dead** when it has no such target: every leaf it
reaches, and every other held tensor whose own graph is still alive, lies below a dead node.
Detaching a dead graph cannot change any gradient a program can still compute; a graph that is not
dead (a forward not backwarded yet, a graph kept with ``retain_graph=True``, a chain of nodes that
saved nothing) may still be backwarded, and only its owner can say whether it will be.

Nothing here runs a backward or a saved-tensor hook: a saved tensor with an unpack hook (a
non-reentrant checkpoint's, an offloading hook's) is never unpacked; a node holding one counts as
alive unless a backward freed it.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any, NamedTuple

from torch.autograd.function import BackwardCFunction

from .._compat import UNKNOWN, degraded, saved_tensor_parts
from .nodes import saved_names

__all__ = ["GraphState", "Liveness", "dead_node"]


_MAX_NESTING = 64  # held graphs inside held graphs (``totals.append(total)`` of running sums) judged recursively


def _hooked(value: Any) -> bool:
    """Whether a raw saved tensor (or any of a list of them) has, or may have, an unpack hook: a torch
    that cannot tell (before 2.13) counts every one as hooked, and says so once."""
    saved = value if isinstance(value, (list, tuple)) else (value,)
    hooks = [saved_tensor_parts(s)[1] for s in saved if s is not None]
    if any(h is UNKNOWN for h in hooks):
        degraded("saved tensors")
        return True
    return any(h is not None for h in hooks)


def _refused(read: Any) -> bool:
    """Whether reading the saved tensors the way backward does (``read()``) is refused."""
    try:
        read()
    except RuntimeError:
        return True
    return False


def dead_node(node: Any) -> bool:
    """Whether running ``node`` in a backward must fail (see the module documentation).

    Each saved tensor is read through the node's own accessor, as backward reads it, so torch
    applies its own checks; one with an unpack hook is not read (a backward that freed it makes the
    raw accessor refuse too).
    """
    if isinstance(node, BackwardCFunction):
        try:
            saved = node._raw_saved_tensors  # refused once a backward freed the function's buffers
        except RuntimeError:
            return True
        return not _hooked(saved) and _refused(lambda: node.saved_tensors)
    for name in saved_names(node):
        try:
            raw = getattr(node, name)
        except RuntimeError:
            return True
        if _hooked(raw):
            continue
        if _refused(functools.partial(getattr, node, "_saved_" + name[len("_raw_saved_") :])):
            return True
    return False


class GraphState(NamedTuple):
    """What :meth:`Liveness.state` found for one graph.

    ``alive``: a backward through it can still succeed for some target. ``leaves``: the ids of the
    leaf tensors (``AccumulateGrad`` variables) its nodes reach, dead nodes' subgraphs included.
    ``nodes``: its distinct nodes, leaves' ``AccumulateGrad`` nodes excluded (those live as long as
    their leaf anyway).
    """

    alive: bool
    leaves: frozenset[int]
    nodes: int


class Liveness:
    """Graph states for one audit: ``held`` are the nodes (``grad_fn``) of the graph tensors the
    program holds, other targets a backward may stop at. Node verdicts are cached for the
    instance's life: make one per audit, and drop it (it holds the nodes it met)."""

    def __init__(self, held: set[Any]) -> None:
        self.held = held
        self._dead: dict[Hashable, bool] = {}
        self._states: dict[Hashable, GraphState] = {}
        self._depth = 0

    def dead(self, node: Any) -> bool:
        verdict = self._dead.get(node)
        if verdict is None:
            verdict = self._dead[node] = dead_node(node)
        return verdict

    def state(self, root: Any) -> GraphState:
        """The state of the graph from the node ``root`` (see :class:`GraphState`)."""
        known = self._states.get(root)
        if known is None:
            self._depth += 1
            try:
                known = self._states[root] = self._walk(root)
            finally:
                self._depth -= 1
        return known

    def _target(self, node: Any) -> bool:
        """Whether another held tensor's node is a target a backward could stop at: its own graph is
        alive. Held graphs nested deeper than :data:`_MAX_NESTING` count as alive (a guess on the
        safe side: the graph holding them is then not repaired)."""
        if self._depth >= _MAX_NESTING and node not in self._states:
            return True
        return self.state(node).alive

    def _walk(self, root: Any) -> GraphState:
        children: dict[Any, list[Any]] = {}
        parents_left: dict[Any, int] = {}
        stack, seen = [root], {root}
        while stack:
            node = stack.pop()
            kids = [child for child, _ in node.next_functions if child is not None]
            children[node] = kids
            for child in kids:
                parents_left[child] = parents_left.get(child, 0) + 1
                if child not in seen:
                    seen.add(child)
                    stack.append(child)
        # Topological order from the root: a node is tainted when it is dead or lies below a dead node.
        tainted: set[Any] = set()
        leaves: set[int] = set()
        alive = False
        nodes = 0
        ready = [root]
        while ready:
            node = ready.pop()
            variable = getattr(node, "variable", None)  # only AccumulateGrad has one
            clean = node not in tainted
            if variable is not None:
                leaves.add(id(variable))
                alive = alive or clean
            else:
                nodes += 1
                if clean and node is not root and node in self.held and self._target(node):
                    alive = True  # autograd.grad(..., inputs=[that tensor]) stops here and can succeed
                if clean and self.dead(node):
                    clean = False
            for child in children[node]:
                if not clean:
                    tainted.add(child)
                parents_left[child] -= 1
                if not parents_left[child]:
                    ready.append(child)
        return GraphState(alive, frozenset(leaves), nodes)
