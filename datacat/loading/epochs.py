"""Which records an epoch delivers to each rank, in what order, in which batches.

Framework-free arithmetic both backends share, so torch and jax deliver the
same records in the same order for the same Plan, seed and epoch:

- The epoch's sequence is a permutation of the selected records (random
  access formats: a keyed Feistel bijection, :mod:`datacat.loading.shuffle`),
  or the shards in a permuted order read front to back (stream formats).
- Random access formats are read in **global steps**: step ``g`` covers the
  next ``batch_size x world_size`` positions of the sequence, each rank
  taking its contiguous share, so the records delivered after any step are
  a prefix of the sequence whatever the world size, and a rank's order for
  W ranks and batch B is a single process's with batch B x W, split. A run
  resumed on another world size or batch size starts its steps where the
  saved run's stopped (``first``): elastic resume. The last step is
  smaller; when it would leave a rank without a record it shares the step
  before it.
- Stream formats give each rank one contiguous slice (each reads its shards
  front to back). Slices differ by at most one record.
- Every rank gets the same number of batches: with ``drop_remainder`` the
  tail that fills no batch on every rank is dropped (documented), without
  it the last batches are made smaller rather than missing, so a rank never
  waits for a batch that does not come.
- Every record of the split is delivered exactly once per epoch.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from datacat.errors import OptionError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Schedule", "cumulative", "locate", "plan_schedule", "round_robin_consumed", "stepped_schedule"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rank's part of an epoch: the sizes of its batches and where each begins in the epoch's sequence.

    Built with ``batch_starts`` None, the batches lie one after another from
    ``start`` (one contiguous slice, ``[start, stop)``).
    """

    records: int
    """Records in the epoch's sequence, all ranks together."""
    start: int
    stop: int
    batch_sizes: tuple[int, ...]
    batch_starts: tuple[int, ...] | None = None
    steps: tuple[int, ...] = ()
    """Records all ranks take at each step (global steps only): the global position after ``b`` batches is
    ``first + sum(steps[:b])``."""
    first: int = 0
    """The sequence position the steps begin at: records before it were delivered before a resume."""
    order: Any = dataclasses.field(default=None, compare=False, repr=False)
    """A bucketed epoch's sequence (numpy int64: the selection index at each position), else None (a shuffle)."""
    step_buckets: tuple[int, ...] = ()
    """A bucketed epoch's bucket of each step in ``steps``."""

    def __post_init__(self) -> None:
        if self.batch_starts is None:
            starts = itertools.accumulate(self.batch_sizes[:-1], initial=self.start)
            object.__setattr__(self, "batch_starts", tuple(starts) if self.batch_sizes else ())
        object.__setattr__(self, "_offsets", tuple(itertools.accumulate(self.batch_sizes, initial=0)))
        object.__setattr__(self, "_step_starts", tuple(itertools.accumulate(self.steps, initial=self.first)))

    @property
    def batches(self) -> int:
        return len(self.batch_sizes)

    @property
    def count(self) -> int:
        """Records this rank reads."""
        return sum(self.batch_sizes)

    @property
    def elastic(self) -> bool:
        """Whether this schedule is in global steps (so a run may resume on another world size)."""
        return bool(self.steps) or (self.batches == 0 and self.first > 0)

    def at(self, index: int) -> int:
        """The sequence position of this rank's ``index``-th record."""
        offsets: tuple[int, ...] = self._offsets  # type: ignore[attr-defined]
        batch = bisect.bisect_right(offsets, index) - 1
        assert self.batch_starts is not None
        return self.batch_starts[batch] + index - offsets[batch]

    def at_all(self, indices: Sequence[int]) -> list[int]:
        """``[self.at(i) for i in indices]``, one lookup when every index lies in one batch (a batch's own)."""
        if not indices:
            return []
        offsets: tuple[int, ...] = self._offsets  # type: ignore[attr-defined]
        first, last = min(indices), max(indices)
        batch = bisect.bisect_right(offsets, first) - 1
        if first >= 0 and last < offsets[batch + 1]:  # one batch: its positions are its start plus the offset
            assert self.batch_starts is not None
            start = self.batch_starts[batch] - offsets[batch]
            return [start + i for i in indices]
        return [self.at(i) for i in indices]

    def at_range(self, indices: Sequence[int]) -> range | None:
        """The sequence positions of ``indices`` as one range, when they are a range inside one batch (a batch's own)."""
        offsets: tuple[int, ...] = self._offsets  # type: ignore[attr-defined]
        if isinstance(indices, range) and indices.step == 1 and len(indices):
            batch = bisect.bisect_right(offsets, indices.start) - 1
            if indices.start >= 0 and indices.stop <= offsets[batch + 1]:
                assert self.batch_starts is not None
                start = self.batch_starts[batch] - offsets[batch]
                return range(start + indices.start, start + indices.stop)
        return None

    def at_array(self, indices: Sequence[int]) -> np.ndarray:
        """:meth:`at_all` as an int64 array; a range inside one batch (a batch's own) made without a Python loop."""
        import numpy as np

        span = self.at_range(indices)
        if span is not None:
            return np.arange(span.start, span.stop, dtype=np.int64)
        return np.asarray(self.at_all(indices), dtype=np.int64)

    def bucket_at(self, position: int) -> int:
        """The bucket of sequence position ``position`` of a bucketed epoch."""
        starts: tuple[int, ...] = self._step_starts  # type: ignore[attr-defined]
        return self.step_buckets[bisect.bisect_right(starts, position) - 1]

    def position(self, batches: int) -> int:
        """The global sequence position once every rank has taken ``batches`` batches (global steps only)."""
        return self.first + sum(self.steps[:batches])


def plan_schedule(
    records: int,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    drop_remainder: bool,
    name: str = "",
    steps: bool = True,
    first: int = 0,
) -> Schedule:
    """The batches of ``rank``, such that every rank has the same number of batches.

    ``steps``: in global steps from sequence position ``first`` (random
    access formats); else one contiguous slice a rank (stream formats).
    Raises ``OptionError`` naming the numbers when the records cannot give
    every rank at least one batch.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise OptionError(f"rank {rank} is outside a world of {world_size}")
    if batch_size < 1:
        raise OptionError(f"batch_size must be at least 1, not {batch_size}")
    if not 0 <= first <= records:
        raise OptionError(f"{name}: a resume at record {first} is outside the epoch's {records} records")
    if steps:
        return _global_steps(records, rank, world_size, batch_size, drop_remainder, name, first)
    what = f"{name}: " if name else ""
    if drop_remainder:
        per_rank_batches = records // (world_size * batch_size)
        if per_rank_batches == 0:
            raise OptionError(
                f"{what}{records} records cannot fill one batch of {batch_size} on each of {world_size} rank(s); "
                "lower batch_size or pass drop_remainder=False"
            )
        size = per_rank_batches * batch_size
        return Schedule(records, rank * size, (rank + 1) * size, (batch_size,) * per_rank_batches)
    per_rank_batches = -(-records // (world_size * batch_size))
    base, extra = divmod(records, world_size)
    if base < per_rank_batches:
        raise OptionError(
            f"{what}{records} records cannot give each of {world_size} rank(s) the same number of batches "
            f"({per_rank_batches}) of at most {batch_size}; lower world_size or batch_size"
        )
    start = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    sizes, left = [], count
    for i in range(per_rank_batches):
        # Full batches first; the last ones shrink so that none is empty.
        size = min(batch_size, left - (per_rank_batches - i - 1))
        sizes.append(size)
        left -= size
    return Schedule(records, start, start + count, tuple(sizes))


def _global_steps(
    records: int, rank: int, world: int, batch: int, drop_remainder: bool, name: str, first: int
) -> Schedule:
    what = f"{name}: " if name else ""
    left, step = records - first, batch * world
    if drop_remainder:
        sizes = [step] * (left // step)
        if not sizes and first == 0:
            raise OptionError(
                f"{what}{records} records cannot fill one batch of {batch} on each of {world} rank(s); "
                "lower batch_size or pass drop_remainder=False"
            )
    else:
        sizes = [step] * (left // step) + ([left % step] if left % step else [])
        if len(sizes) > 1 and sizes[-1] < world:  # the last step would leave a rank without a record
            both = sizes[-2] + sizes.pop()
            sizes[-1:] = [both - both // 2, both // 2]
        if any(size < world for size in sizes):
            raise OptionError(
                f"{what}{left} records{' left after the resume point' if first else ''} cannot give each of "
                f"{world} rank(s) the same number of batches of at most {batch}; lower world_size or batch_size"
            )
    return stepped_schedule(records, sizes, rank=rank, world_size=world, first=first)


def stepped_schedule(
    records: int,
    steps: Sequence[int],
    *,
    rank: int,
    world_size: int,
    first: int = 0,
    order: Any = None,
    step_buckets: Sequence[int] = (),
) -> Schedule:
    """``rank``'s batches of global steps of the given sizes from sequence position ``first``: its share of each.

    Each step must give every rank a record. ``order`` and ``step_buckets``
    are a bucketed epoch's (:mod:`datacat.loading.buckets`).
    """
    starts, mine = [], []
    at = first
    for size in steps:
        base, extra = divmod(size, world_size)
        starts.append(at + rank * base + min(rank, extra))
        mine.append(base + (1 if rank < extra else 0))
        at += size
    lo = starts[0] if starts else first
    return Schedule(
        records, lo, lo + sum(mine), tuple(mine), tuple(starts), tuple(steps), first, order, tuple(step_buckets)
    )


def round_robin_consumed(lengths: Sequence[int], taken: int) -> list[int]:
    """How many items each queue gave after ``taken`` items drawn round-robin (exhausted queues drop out)."""
    consumed = [0] * len(lengths)
    left = taken
    order = sorted(range(len(lengths)), key=lambda k: lengths[k])
    done_rounds = 0
    active = [k for k in range(len(lengths)) if lengths[k] > 0]
    for k in order:
        rounds = lengths[k] - done_rounds
        if rounds <= 0 or not active:
            continue
        # ``rounds`` full rounds over every active queue fit before queue k runs dry.
        full = min(rounds, left // len(active))
        for j in active:
            consumed[j] += full
        left -= full * len(active)
        done_rounds += full
        if full < rounds:
            for j in sorted(active)[:left]:
                consumed[j] += 1
            return consumed
        active = [j for j in active if lengths[j] > done_rounds]
    return consumed


def locate(cumulative: Sequence[int], index: int) -> tuple[int, int]:
    """(part, offset) of ``index`` in parts whose cumulative lengths start at 0."""
    part = bisect.bisect_right(cumulative, index) - 1
    return part, index - cumulative[part]


def cumulative(lengths: Sequence[int]) -> list[int]:
    """Start offsets of consecutive parts, with the total last."""
    return list(itertools.accumulate(lengths, initial=0))
