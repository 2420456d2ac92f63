"""The holders a watcher found leaking, followed by name: read again without a pass over the heap, and in
``detach`` mode refilled (the dead graphs they took since, repaired).

A leaking holder reached from a module global or from a running function's local, or one found keeping a
graph for one boundary (it may keep it for a second), is remembered as a
:class:`~gradguard._watch.recipes.Recipe` (up to :data:`MOST`, the least recently found forgotten
first). When the old-graph signal asks, these are read first; while a holder ``detach`` repaired keeps
filling, its newest records are read at every boundary and their dead graphs repaired: the holder was
judged a leak, and detaching a dead graph cannot change a gradient, so the record is not judged again
and a leak the program keeps filling stays at about one step's records.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Hashable, Iterable

import torch

from .._graph.liveness import Liveness
from .._graph.stamps import oldest_below
from .._heap.paths import Path
from .criterion import Leak
from .recipes import Recipe
from .records import Records, count_repair, measure_before_repairs
from .repair import repair
from .threads import ThreadState
from .tuning import MOST

__all__ = ["MOST", "Known", "repair_dead"]


class Known:
    """The leaking holders found so far, by name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recipes: collections.OrderedDict[str, Recipe] = collections.OrderedDict()
        self._bounded: set[str] = set()  # the keys remembered as bounded only: forgotten first

    def __bool__(self) -> bool:
        return bool(self._recipes)

    def recipes(self) -> list[Recipe]:
        with self._lock:
            return list(self._recipes.values())

    def remember(self, leaks: Iterable[Leak], bounded: bool = False) -> None:
        """The holders of ``leaks``, by name: read again at later boundaries without searching the heap.
        ``bounded``: holders found keeping a graph for one boundary so far, followed only while there is
        room: one already followed is left as it is, and they are the first forgotten (a leaking holder
        never gives way to one)."""
        with self._lock:
            for leak in leaks:
                recipe = Recipe.of(leak.finding.paths[leak.leaking[0]])
                if recipe is None:
                    continue
                key = recipe.key
                if bounded:
                    if key in self._recipes:
                        continue
                    self._bounded.add(key)
                else:
                    self._bounded.discard(key)
                self._recipes[key] = recipe
                self._recipes.move_to_end(key)
                while len(self._recipes) > MOST:
                    victim = next((k for k in self._recipes if k in self._bounded), None)
                    if victim is None:
                        victim = next(iter(self._recipes))
                    del self._recipes[victim]
                    self._bounded.discard(victim)

    def refill(
        self, state: ThreadState, recipes: list[Recipe], boundary: int, source: Hashable, records: Records
    ) -> list[Recipe]:
        """``detach``: the holders repaired before, read by name (their newest records), have the dead
        graphs they took before this step repaired (one that may still be backwarded is left to the
        audits). A record is aged by its own stamp (placed when a backward started from it, or when this
        first saw it), or when it has none, by the oldest stamp in its graph. Returns the recipes of the
        other holders. Call holding :data:`~gradguard._heap.hold.search_lock`."""
        repaired = records.repaired()
        others = []
        state.refilling = filling = False
        ledger = state.ledger
        for recipe in recipes:
            if recipe.key not in repaired:
                others.append(recipe)
                continue
            pairs = []
            found = recipe.resolve(newer=True)
            filling = filling or bool(found)  # it still holds graphs: read it again at the next boundary
            for t, path in found:
                born = ledger.epoch(t.grad_fn)
                if born is None:  # new here: as old as the oldest graph it holds (a running sum holds the last one)
                    born = oldest_below([t.grad_fn], ledger).get(t.grad_fn)
                    ledger.place(t.grad_fn, boundary - 1)  # made before this boundary, in this step at the latest
                if born is not None and state.clock.survived(source, born) >= 1:
                    pairs.append((t, path))
            del found
            repair_dead(state, recipe.key, pairs, records)
            del pairs
        state.refilling = state.refilling or filling
        return others


def repair_dead(state: ThreadState, key: str, pairs: list[tuple[torch.Tensor, Path]], records: Records) -> None:
    """Repair the dead graphs among ``pairs`` (tensors of holder ``key`` judged a leak, with their paths), and
    count what the repairs released: detaching a dead graph cannot change a gradient."""
    if not pairs:
        return
    tensors = [t for t, _ in pairs]
    liveness = Liveness({t.grad_fn for t in tensors})
    alive = [liveness.state(t.grad_fn).alive for t in tensors]
    del liveness
    if all(alive):
        return
    measure_before_repairs(state)
    done = repair([path for _, path in pairs], tensors, alive)
    del tensors
    pinned, each = records.refilled(key, done.released)
    count_repair(state, key, done, pinned, each * done.released)
