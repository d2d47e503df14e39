"""Which records an epoch delivers to each rank, in what order, in which batches.

Framework-free arithmetic both backends share, so torch and jax deliver the
same records in the same order for the same Plan, seed and epoch:

- The epoch's sequence is a permutation of the selected records (random
  access formats: a keyed Feistel bijection, :mod:`datacat.loading.shuffle`),
  or the shards in a permuted order read front to back (stream formats).
- Each rank reads one contiguous slice of that sequence. Slices differ by
  at most one record, and every rank gets the same number of batches: with
  ``drop_remainder`` the tail that fills no batch on every rank is dropped
  (documented), without it the last batches of a rank are made smaller
  rather than missing, so a rank never waits for a batch that does not come.
- Every record of the split is delivered exactly once per epoch.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Sequence

from datacat.errors import OptionError

__all__ = ["Schedule", "cumulative", "locate", "plan_schedule", "round_robin_consumed"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rank's part of an epoch: a slice of the sequence and the sizes of its batches."""

    records: int
    """Records in the epoch's sequence, all ranks together."""
    start: int
    stop: int
    batch_sizes: tuple[int, ...]

    @property
    def batches(self) -> int:
        return len(self.batch_sizes)


def plan_schedule(
    records: int, *, rank: int, world_size: int, batch_size: int, drop_remainder: bool, name: str = ""
) -> Schedule:
    """The slice and batch sizes of ``rank``, such that every rank has the same number of batches.

    Raises ``OptionError`` naming the numbers when the records cannot give
    every rank at least one batch.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise OptionError(f"rank {rank} is outside a world of {world_size}")
    if batch_size < 1:
        raise OptionError(f"batch_size must be at least 1, not {batch_size}")
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
