"""A signal's back-off, the same on both clocks: while its requests find nothing new, each waits for a gap
that doubles (up to :data:`~gradguard._watch.tuning.GAP_CAP` boundaries) once the free ones are spent."""

from __future__ import annotations

import dataclasses

from .tuning import GAP_CAP

__all__ = ["Backoff"]


@dataclasses.dataclass
class Backoff:
    """One signal's requests: how many in a row found nothing new, and from which boundary it may ask again.

    Attributes:
        misses: Requests in a row that found nothing new.
        gap: The wait after the next one that finds nothing new, in boundaries.
        next_at: The boundary from which the signal may ask again.
        cost: The last request's seconds.
    """

    misses: int = 0
    gap: int = 1
    next_at: int = 0
    cost: float = 0.0

    def handled(self, at: int, cost: float, new: bool, free: int) -> None:
        """A request was handled at boundary ``at`` in ``cost`` seconds; ``new``: it found something new
        (the back-off starts afresh); ``free``: how many in a row that find nothing are served at once."""
        self.cost = cost
        if new:
            self.misses, self.gap, self.next_at = 0, 1, 0
            return
        self.misses += 1
        if self.misses >= free:
            self.next_at = at + self.gap
            self.gap = min(2 * self.gap, GAP_CAP)
