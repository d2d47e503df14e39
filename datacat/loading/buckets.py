"""Aspect-ratio buckets: each record in the bucket nearest its aspect ratio, and epochs whose every step is one bucket.

A record's bucket comes from its stored image's height and width (the
entry's metadata table: no decode), nearest in log aspect ratio. An epoch
shuffles each bucket's records (seeded by seed and epoch), cuts each into
global steps of ``batch_size x world_size`` records, and shuffles the
steps: every rank's batch of a step is from the step's bucket, every
record is delivered once an epoch, and the same seed gives the same epoch
in any process. A bucket's last step is smaller; with ``drop_remainder`` it
is left out of that epoch (other records each epoch, as the shuffle
differs), and a step that would leave a rank without a record shares the
step before it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from datacat.errors import OptionError
from datacat.loading.epochs import Schedule, cumulative, stepped_schedule
from datacat.loading.shuffle import epoch_key

__all__ = ["Bucketing", "nearest_buckets"]


def nearest_buckets(sizes: Sequence[tuple[int, int]], stored: np.ndarray) -> np.ndarray:
    """The index of the bucket nearest each stored (height, width) in log aspect ratio (ties: the first)."""
    buckets = np.log(np.asarray([w / h for h, w in sizes], dtype=np.float64))
    ratios = np.log(stored[:, 1].astype(np.float64) / stored[:, 0].astype(np.float64))
    nearest: np.ndarray = np.abs(ratios[:, None] - buckets[None, :]).argmin(axis=1).astype(np.int16)
    return nearest


class Bucketing:
    """The buckets of one source's selection: their sizes and each selected record's bucket."""

    def __init__(self, name: str, sizes: Sequence[tuple[int, int]], assignment: np.ndarray) -> None:
        self.name = name
        self.sizes = tuple(sizes)
        self.assignment = assignment  # bucket of each index of the source's selection

    def __repr__(self) -> str:
        held = ", ".join(f"{h}x{w}: {n}" for (h, w), n in zip(self.sizes, self.counts(), strict=True))
        return f"Bucketing({self.name!r}, {held})"

    def counts(self) -> list[int]:
        """Records in each bucket."""
        return np.bincount(self.assignment, minlength=len(self.sizes)).tolist()  # type: ignore[no-any-return]

    def schedule(
        self,
        seed: int,
        epoch: int,
        *,
        shuffle: bool,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_remainder: bool,
        first: int = 0,
    ) -> Schedule:
        """``rank``'s batches of epoch ``epoch``, each from one bucket; from sequence position ``first`` on resume."""
        order, steps, buckets = self._epoch(seed, epoch, shuffle, world_size, batch_size, drop_remainder)
        starts = cumulative(steps)
        if first not in starts:
            raise OptionError(
                f"{self.name}: a bucketed epoch resumes only where a step began; position {first} is inside one "
                "(resume with the world size and batch size the state was saved with)"
            )
        k = starts.index(first)
        return stepped_schedule(
            len(order),
            steps[k:],
            rank=rank,
            world_size=world_size,
            first=first,
            order=order,
            step_buckets=buckets[k:],
        )

    @functools.lru_cache(maxsize=2)  # noqa: B019 - two epochs' orders kept: the one read and the next
    def _epoch(
        self, seed: int, epoch: int, shuffle: bool, world: int, batch: int, drop: bool
    ) -> tuple[np.ndarray, list[int], list[int]]:
        rng = np.random.Generator(np.random.Philox(key=epoch_key(seed, epoch, "buckets")))
        step = batch * world
        parts: list[tuple[int, np.ndarray]] = []
        for bucket, (height, width) in enumerate(self.sizes):
            members = np.flatnonzero(self.assignment == bucket)
            if shuffle:
                members = rng.permutation(members)
            full = len(members) // step
            mine = [members[i * step : (i + 1) * step] for i in range(full)]
            rest = members[full * step :]
            if len(rest) and not drop:
                if len(rest) >= world:
                    mine.append(rest)
                elif mine and step + len(rest) >= 2 * world:  # shares the step before it, halved
                    both = np.concatenate([mine.pop(), rest])
                    half = len(both) - len(both) // 2
                    mine += [both[:half], both[half:]]
                else:
                    raise OptionError(
                        f"{self.name}: bucket {height}x{width} ends an epoch with {len(rest)} record(s), fewer than "
                        f"the {world} ranks; pass drop_remainder=True (such records then wait for another epoch) "
                        "or use fewer buckets"
                    )
            parts += [(bucket, p) for p in mine]
        if not parts:
            raise OptionError(
                f"{self.name}: no bucket holds a batch of {batch} on each of {world} rank(s); lower batch_size, "
                "use fewer buckets, or pass drop_remainder=False"
            )
        picked = rng.permutation(len(parts)) if shuffle else range(len(parts))
        ordered = [parts[i] for i in picked]
        order = np.concatenate([p for _, p in ordered]).astype(np.int64)
        return order, [len(p) for _, p in ordered], [b for b, _ in ordered]
