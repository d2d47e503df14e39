"""Whether a thread should read the next batches ahead: how long the loop waits for them, or is away from them.

A batch filled by one thread (embedding rows in runs: a few slice copies)
is read ahead so that the read hides behind the loop's own work between
batches (its training step). A loop that comes back sooner than a read
takes waits for the thread anyway and pays the handoff on top: the thread
and the loop's futures wake each other for every batch, and on two cores
a copy runs slower while the other core is busy. Such a loop is faster
reading the batch itself, where it asks for it:

    embedding rows in runs of 64, torch, no workers, 2 cores (AMD), three
    pairs: a loop that only iterates 0.39-0.62 of memcpy read in the loop,
    0.28-0.39 read ahead; a loop away 0.5 ms a batch 0.17-0.20 read in the
    loop, 0.29-0.34 read ahead.

:class:`Pace` measures, as moving averages, a batch's read, the loop's
wait for a batch read ahead and its time away between batches, and says
which way the next batches go. It only decides when; the batches are the
same either way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Pace"]

_WEIGHT = 0.25
"""The weight of the newest duration in each moving average."""

_WAITS = 0.75
"""Reading ahead stops when the loop waits this share of a read for each batch: the thread hides little."""

_AWAY = 0.5
"""Reading ahead starts again when the loop is away this share of a read between batches."""


class Pace:
    """One process's reads against its loop: whether the next batches are read ahead in a thread.

    ``ahead`` starts true. Reading ahead, it turns false once the loop
    waits for most of each read; reading where the loop asks, true again
    once the loop is away for half a read or more between batches. The two
    shares differ so that a loop near the line does not swing between them.
    Read threads and the loop update it without a lock: a lost update only
    delays a decision by a batch.
    """

    def __init__(self) -> None:
        self.ahead = True
        self.read_s: float | None = None  # a batch's read, in whichever thread
        self.wait_s: float | None = None  # the loop's wait for a batch read ahead (reading ahead only)
        self.away_s: float | None = None  # the loop's time between taking a batch and asking for the next

    def __repr__(self) -> str:
        return f"Pace(ahead={self.ahead}, read_s={self.read_s}, wait_s={self.wait_s}, away_s={self.away_s})"

    def __getstate__(self) -> dict[str, Any]:
        return Pace().__dict__  # another process measures its own

    def read(self, seconds: float) -> None:
        """A batch took ``seconds`` to read."""
        self.read_s = _average(self.read_s, seconds)

    def waited(self, seconds: float) -> None:
        """The loop waited ``seconds`` for a batch read ahead."""
        self.wait_s = _average(self.wait_s, seconds)
        if self.read_s is not None and self.wait_s > _WAITS * self.read_s:
            self.ahead, self.wait_s = False, None

    def away(self, seconds: float) -> None:
        """The loop was away ``seconds`` between taking a batch and asking for the next."""
        if self.read_s is not None:  # a pause (an evaluation between epochs) counts as a long step, no more
            seconds = min(seconds, 2 * self.read_s)
        self.away_s = _average(self.away_s, seconds)
        if not self.ahead and self.read_s is not None and self.away_s > _AWAY * self.read_s:
            self.ahead = True


def _average(average: float | None, seconds: float) -> float:
    return seconds if average is None else average + _WEIGHT * (seconds - average)
