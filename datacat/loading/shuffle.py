"""The shuffles of an epoch: a keyed Feistel bijection of record positions, its runs of neighbours, and the order of stream shards.

All are computed from the seed and the epoch alone (no index array however
large the dataset), so every process of every rank draws the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

__all__ = ["Feistel", "Order", "RunShuffle", "epoch_key", "shard_order"]


class Order(Protocol):
    """An epoch's order of its records: ``order[j]`` is the record read ``j``-th (a shuffle, or a bucketed epoch's)."""

    def __getitem__(self, index: int) -> int: ...

    def take(self, indices: Sequence[int]) -> list[int]:
        """``[order[j] for j in indices]``."""
        ...

    def take_array(self, indices: np.ndarray) -> np.ndarray:
        """``order[j]`` for every ``j`` of an int64 array."""
        ...

    def take_range(self, start: int, stop: int) -> np.ndarray:
        """``order[j]`` for ``j`` in ``range(start, stop)`` (a batch's neighbouring indices), as an int64 array."""
        ...


def epoch_key(seed: int, epoch: int, salt: str = "") -> int:
    """A 64-bit key for one epoch of one seed; different salts give unrelated keys."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Feistel:
    """A bijection of ``range(n)`` keyed by a 64-bit key: a shuffle with O(1) memory.

    A 4-round Feistel network over the smallest even-bit domain >= n, with
    cycle walking to stay inside ``range(n)``.
    """

    BLOCK = 1024  # indices whose permutation take() computes at once

    def __init__(self, n: int, key: int) -> None:
        self.n = n
        bits = max(2, (max(n - 1, 1)).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = (1 << self.half) - 1
        self.keys = [epoch_key(key, r, "feistel") for r in range(4)]
        self._cached: tuple[int | None, list[int]] = (None, [])  # take()'s last block of the permutation
        self._spans: tuple[tuple[int, np.ndarray], ...] = ()  # take_range()'s last blocks, as arrays
        self._numpy: tuple[Any, ...] | None = None  # _permute_all's constants as numpy scalars

    def _round(self, value: int, key: int) -> int:
        x = (value * 0x9E3779B1 + key) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 29
        x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        return (x ^ (x >> 32)) & self.mask

    def _permute(self, value: int) -> int:
        left, right = value >> self.half, value & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return self._walk(self._permute(index))

    def _walk(self, value: int) -> int:
        # Cycle walking: permuted again until inside range(n).
        while value >= self.n:
            value = self._permute(value)
        return value

    def take(self, indices: Sequence[int]) -> list[int]:
        """``[self[i] for i in indices]``, for neighbouring indices (a batch's) at a fraction of the cost.

        The permutation of the aligned block of ``BLOCK`` indices around
        them is computed at once in numpy and the last block kept (8 KiB):
        ~4k instructions an index used, against ~36k one at a time in Python.
        """
        out = []
        cached = self._cached  # one attribute, replaced whole: threads reading ahead share it safely
        for index in indices:
            block, offset = divmod(index, self.BLOCK)
            if block != cached[0]:
                if not 0 <= index < self.n:
                    raise IndexError(index)
                cached = self._cached = (block, self._permute_block(block))
            out.append(cached[1][offset])
        return out

    def take_array(self, indices: np.ndarray) -> np.ndarray:
        """``self[i]`` for every ``i`` of an int64 array, computed in numpy (a batch's positions for the batch path)."""
        import numpy as np

        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.n):
            raise IndexError(int(indices.min()) if int(indices.min()) < 0 else int(indices.max()))
        values = self._permute_all(indices.astype(np.uint64))
        outside = np.flatnonzero(values >= self.n)
        while len(outside) > 8:  # cycle walking, as __getitem__ does
            values[outside] = self._permute_all(values[outside])
            outside = outside[values[outside] >= self.n]
        for i in outside.tolist():  # the last few one at a time: a numpy pass costs as much as a few in Python
            values[i] = self._walk(int(values[i]))
        return values.astype(np.int64)

    SPAN = 1 << 14
    """Indices of the aligned blocks take_range() computes at once and keeps (the last few, 128 KiB each)."""

    def take_range(self, start: int, stop: int) -> np.ndarray:
        """``self[i]`` for ``i`` in ``range(start, stop)`` (a batch's neighbouring indices) as an int64 array.

        Each aligned block of ``SPAN`` indices is permuted at once and the
        last four kept: a batch of 1,024 then costs a slice, where its own
        pass of ~40 small numpy calls held the GIL for ~0.15 ms.
        """
        import numpy as np

        if not 0 <= start <= stop <= self.n:
            raise IndexError(start if start < 0 else stop - 1)
        if start == stop:
            return np.zeros(0, np.int64)
        pieces = []
        for block in range(start // self.SPAN, (stop - 1) // self.SPAN + 1):
            begin = block * self.SPAN
            pieces.append(self._span_block(block)[max(start - begin, 0) : stop - begin])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _span_block(self, block: int) -> np.ndarray:
        spans = self._spans  # one attribute, replaced whole: threads reading ahead share it safely
        for held, values in spans:
            if held == block:
                return values
        import numpy as np

        indices = np.arange(block * self.SPAN, min((block + 1) * self.SPAN, self.n), dtype=np.int64)
        values = self.take_array(indices)
        values.flags.writeable = False  # slices of it are handed out
        self._spans = ((block, values), *spans[:3])
        return values

    def _permute_block(self, block: int) -> list[int]:
        import numpy as np  # the catalog layer needs no numpy: imported where an epoch is read

        values = np.arange(block * self.BLOCK, min((block + 1) * self.BLOCK, self.n), dtype=np.uint64)
        values = self._permute_all(values)
        outside = np.flatnonzero(values >= self.n)
        while len(outside) > 8:  # cycle walking, as __getitem__ does, for the values that left range(n)
            values[outside] = self._permute_all(values[outside])
            outside = outside[values[outside] >= self.n]
        permuted: list[int] = values.tolist()
        for i in outside.tolist():  # the last few one at a time: a numpy pass costs as much as a few in Python
            permuted[i] = self._walk(permuted[i])
        return permuted

    def _permute_all(self, values: np.ndarray) -> np.ndarray:
        # _permute on a uint64 array: its products wrap modulo 2**64 as _round's masks do.
        half, mask, multipliers, shifts, keys = self._constants()
        left, right = values >> half, values & mask
        for key in keys:
            x = right * multipliers[0]
            x += key
            x ^= x >> shifts[0]
            x *= multipliers[1]
            x ^= x >> shifts[1]
            x &= mask
            x ^= left
            left, right = right, x
        left <<= half
        left |= right
        permuted: np.ndarray = left
        return permuted

    def _constants(self) -> tuple[Any, ...]:
        import numpy as np

        if self._numpy is None:
            u = np.uint64
            self._numpy = (
                u(self.half),
                u(self.mask),
                (u(0x9E3779B1), u(0xBF58476D1CE4E5B9)),
                (u(29), u(32)),
                [u(key) for key in self.keys],
            )
        return self._numpy

    def __len__(self) -> int:
        return self.n


class RunShuffle:
    """A bijection of ``range(n)`` that moves runs of ``run`` neighbouring records together (FFCV's quasi-random order).

    The sequence is the records cut into runs of ``run``, the runs in a
    Feistel order, then turned by an offset drawn from the key (so the runs'
    boundaries, and the ``n % run`` records read last, differ each epoch).
    A batch is then a few contiguous stretches of its table: an embedding
    row is copied with its neighbours instead of alone. Neighbours share
    batches, so this is for records whose stored order is already mixed.
    """

    def __init__(self, n: int, key: int, run: int) -> None:
        if run < 1:
            raise ValueError(f"a shuffle's run is at least 1 record, not {run}")
        self.n, self.run = n, run
        self.runs = n // run
        self.runs_order = Feistel(max(self.runs, 1), key)
        self.turn = epoch_key(key, 0, "turn") % max(n, 1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        block, offset = divmod(index, self.run)
        record = self.runs_order[block] * self.run + offset if block < self.runs else index
        return (record + self.turn) % self.n

    def take(self, indices: Sequence[int]) -> list[int]:
        import numpy as np

        out: list[int] = self.take_array(np.asarray(indices, dtype=np.int64)).tolist()
        return out

    def take_array(self, indices: np.ndarray) -> np.ndarray:
        """``self[i]`` for every ``i`` of an int64 array: one Feistel evaluation a run, not a record."""
        import numpy as np

        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.n):
            raise IndexError(int(indices.min()) if int(indices.min()) < 0 else int(indices.max()))
        blocks, offsets = np.divmod(indices, self.run)
        inside = blocks < self.runs
        firsts, which = np.unique(blocks[inside], return_inverse=True)
        records = indices.copy()
        records[inside] = self.runs_order.take_array(firsts)[which] * self.run + offsets[inside]
        records += self.turn
        records %= self.n
        return records

    def take_range(self, start: int, stop: int) -> np.ndarray:
        """``self[i]`` for ``i`` in ``range(start, stop)`` (a batch's neighbouring indices): its runs from :meth:`Feistel.take_range`.

        A batch of 1,024 in runs of 64 took ~0.25 ms by :meth:`take_array`
        (a sort to find its runs, a Feistel pass over them), as long as
        copying its rows.
        """
        import numpy as np

        if not 0 <= start <= stop <= self.n:
            raise IndexError(start if start < 0 else stop - 1)
        records = np.arange(start, stop, dtype=np.int64)
        inside = max(0, min(stop, self.runs * self.run) - start)  # the records in whole runs lead
        if inside:
            first = start // self.run
            head = records[:inside]
            blocks = head // self.run
            moved = self.runs_order.take_range(first, int(blocks[-1]) + 1)
            head += (moved[blocks - first] - blocks) * self.run  # each run's records to where its run went
        records += self.turn
        records %= self.n
        return records


def shard_order(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order stream shards are read in one epoch."""
    if not shuffle:
        return list(range(n_shards))
    perm = Feistel(n_shards, epoch_key(seed, epoch, "shards"))
    return [perm[i] for i in range(n_shards)]
