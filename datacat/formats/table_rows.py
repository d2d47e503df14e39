"""Embedding-table rows read a batch at a time: one gather over every shard's memory-mapped ``.npy`` into the batch."""

from __future__ import annotations

import concurrent.futures
import ctypes
import math
import mmap
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from datacat.formats import Filled, Reader
from datacat.storage import is_remote

if TYPE_CHECKING:
    import numpy as np

    from datacat.formats.embedding_table import EmbeddingTableReader
    from datacat.plan import Plan

__all__ = ["ArrowColumn", "RowGather", "RowKeys", "RowsFill", "rows_fill"]


_UNIT = 32
"""Bytes of the smallest unit gathered by ``np.take``; rows at addresses that share no larger one are fancy-indexed."""

_STRETCH = 8
"""Rows a stretch must average for a batch to be copied stretch by stretch (a slice copy costs ~8 rows' gather)."""


class RowGather:
    """Fixed-size rows of several memory-mapped files gathered by one numpy call, however many files a batch touches.

    Each file is mapped whole. The address range from the lowest mapping to
    the end of the highest is one byte array; cut into units of the largest
    size that every row's address and length are multiples of (128 bytes
    for a ``.npy`` of float16 [rows, 768]: its data starts 128 bytes into a
    page-aligned map), row ``i`` of file ``f`` is ``row_bytes / unit``
    consecutive units from ``(start[f] + i * row_bytes) / unit``, and a batch's
    rows from any mix of files are one ``np.take`` of units straight into
    the batch (no temporary; the GIL released). Only rows inside a mapping
    are ever indexed; the mappings live as long as this object. A per-file
    gather was ~15 µs a file and batch: a shuffled batch of a 400-file table
    touches most of them.
    """

    def __init__(self, paths: Sequence[str], offsets: Sequence[int], row_bytes: int) -> None:
        import numpy as np

        self.row_bytes = row_bytes
        self._maps: list[mmap.mmap] = []
        addresses = []
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self._maps.append(mapped)
            addresses.append(np.frombuffer(mapped, np.uint8).ctypes.data)
        base = min(addresses)
        end = max(a + len(m) for a, m in zip(addresses, self._maps, strict=True))
        span = self._span = np.ctypeslib.as_array((ctypes.c_uint8 * (end - base)).from_address(base))
        span.flags.writeable = False
        starts = [a - base + o for a, o in zip(addresses, offsets, strict=True)]
        self.starts = np.asarray(starts, dtype=np.int64)
        self.unit = math.gcd(row_bytes, *starts)
        if self.unit < _UNIT:  # rows at odd addresses: whole rows one byte apart (strides (1, 1)), fancy-indexed
            self._rows = np.lib.stride_tricks.as_strided(
                span, shape=(len(span) - row_bytes + 1, row_bytes), strides=(1, 1), writeable=False
            )
        else:
            self._units = span[: len(span) // self.unit * self.unit].reshape(-1, self.unit)
            self._within = np.arange(row_bytes // self.unit)

    def __repr__(self) -> str:
        return f"RowGather(files={len(self._maps)}, row_bytes={self.row_bytes})"

    def gather(self, files: np.ndarray, rows: np.ndarray, out: np.ndarray, bounds: Sequence[int] | None = None) -> None:
        """Row ``rows[k]`` of file ``files[k]`` into ``out[k]`` (``out``: C-contiguous, ``row_bytes`` a row).

        ``bounds`` (:func:`stretches`) splits a batch whose rows follow each
        other in a file (a run shuffle's batch) into stretches, each copied
        by one slice at memcpy's speed; without them the batch is one take.
        """
        import numpy as np

        size = self.row_bytes
        addresses = self.starts[files] + rows * size
        if bounds is None and self.unit < _UNIT:
            out.view("u1").reshape(-1, size)[:] = self._rows[addresses]
            return
        if bounds is None:
            # One take of the rows' units into the batch. A fancy index of whole rows made a temporary first
            # and copied it again, and take's default mode copies through a buffer as large as the batch;
            # "clip" writes straight into it (every index is a row inside a mapping, by construction). Random
            # order, batches of 1,024, side by side in 3 alternating pairs: 0.70-0.83M -> 0.96-1.05M rows/s.
            units = (addresses // self.unit)[:, None] + self._within
            target = out.view("u1").reshape(-1, self.unit)
            np.take(self._units, units.reshape(-1), axis=0, out=target, mode="clip")
            return
        flat, span = out.view("u1").reshape(-1), self._span
        firsts = addresses[bounds[:-1]].tolist()
        for begin, end, first in zip(bounds[:-1], bounds[1:], firsts, strict=True):
            flat[begin * size : end * size] = span[first : first + (end - begin) * size]


def stretches(files: np.ndarray, rows: np.ndarray) -> list[int] | None:
    """Where a batch's rows break into stretches of neighbours in one file, ``[0, ..., len(rows)]``, for
    :meth:`RowGather.gather`; None when the stretches average fewer than ``_STRETCH`` rows.

    Worked out once a batch, for every table the batch is gathered from.
    """
    import numpy as np

    breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(files) != 0)) + 1
    if len(breaks) * _STRETCH >= len(rows):
        return None
    return [0, *breaks.tolist(), len(rows)]


class _ListLike(Sequence[Any]):
    """A batch column made when read, equal to the list the record path gives (indexable, sliceable, iterable)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, as mutable as one: unhashable

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


class RowKeys(_ListLike, Sequence[str]):
    """A batch's row keys, ``"<shard>:<row>"``, each made when it is read: no Python string a row on the hot path.

    Making 1,024 keys up front held the GIL for ~0.2 ms a batch, more than
    copying the rows.
    """

    __slots__ = ("_names", "_rows", "_shards")

    def __init__(self, names: Sequence[str], shards: np.ndarray, rows: np.ndarray) -> None:
        self._names, self._shards, self._rows = names, shards, rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return list(RowKeys(self._names, self._shards[index], self._rows[index]))
        return f"{self._names[self._shards[index]]}:{self._rows[index]}"

    def __iter__(self) -> Iterator[str]:
        names = self._names
        return (f"{names[s]}:{r}" for s, r in zip(self._shards.tolist(), self._rows.tolist(), strict=True))


class ArrowColumn(_ListLike):
    """A batch's values of one arrow column (its captions), picked and made Python objects when first read.

    A prior's loop mostly reads the embeddings only: the take that picks
    the batch's values (~30 µs a batch of 1,024) and ``to_pylist`` (~60 µs,
    the GIL held) are paid only by a loop that reads them, once (the list
    is kept).
    """

    __slots__ = ("_column", "_list", "_rows")

    def __init__(self, column: Any, rows: np.ndarray) -> None:  # a pyarrow Array, the batch's rows of it
        self._column, self._rows = column, rows
        self._list: list[Any] | None = None

    def _python(self) -> list[Any]:
        if self._list is None:
            self._list = self._column.take(_arrow_indices(self._rows)).to_pylist()
            self._column = None  # the whole column is the table's to keep
        return self._list

    def __len__(self) -> int:
        return len(self._rows) if self._list is None else len(self._list)

    def __getitem__(self, index: int | slice) -> Any:
        return self._python()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._python())

    def __getstate__(self) -> Any:
        return self._python()

    def __setstate__(self, state: Any) -> None:
        self._column, self._list = None, state


class RowsFill:
    """Batches of a local embedding table: each array's rows gathered from the memory-mapped ``.npy`` files into the batch.

    The arrays are the table's own dtype, copied once (no cast: numpy's
    float16 to float32 is ~20x slower than the copy; cast on the device).
    Only captions are made per row (keys on demand: :class:`RowKeys`). A row whose image embedding
    is all zero bytes is left to the record path, which ledgers it.
    """

    def __init__(self, reader: EmbeddingTableReader) -> None:
        import numpy as np

        self.reader = reader
        self.dim = reader.prior.dim
        self.segment_starts = np.asarray(reader.segment_starts, dtype=np.int64)
        self.segment_firsts = np.asarray([first for first, _ in reader.segments] + [0], dtype=np.int64)
        self.shard_starts = np.asarray(reader.starts, dtype=np.int64)
        self.whole_table = reader.segments == ((0, len(reader)),)
        self._gathers: dict[str, RowGather] = {}
        self._lock = threading.Lock()  # the two filling threads map the files and read the captions once
        # Every shard's captions as one arrow array (one take a batch), when the whole table's fit the budget.
        self._whole = reader.prior.captions and reader.captions_fit
        self._captions: Any = None

    def threads(self, run: int) -> int:
        """Two for scattered rows, one for runs of neighbours (no worker processes either way).

        A scattered batch is one take that lets the GIL go, which two
        threads overlap (measured when it was a fancy index a piece: random
        order, 1,024 rows, 0.76-0.82M rows/s against 0.69M with one). A
        batch of runs is a slice copy a run, at memory speed in one thread,
        and a second thread only slowed both (runs of 64: 1.96-1.99M rows/s
        with one, 1.22-1.33M with two; 2 cores, AMD).
        """
        return 2 if run == 1 else 1

    def __repr__(self) -> str:
        return f"RowsFill({self.reader.name!r}, dim={self.dim})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_gathers": {}, "_captions": None, "_lock": None}  # each process maps the files itself

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def arrays(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        keys = ("image_embedding", "text_embedding") if self.reader.prior.text else ("image_embedding",)
        return {key: ((self.dim,), self.reader.prior.dtype) for key in keys}

    def _gather(self, key: str) -> RowGather:
        found = self._gathers.get(key)
        if found is None:
            with self._lock:
                found = self._gathers.get(key)
                if found is None:
                    reader = self.reader
                    image = key == "image_embedding"
                    paths = reader.images if image else reader.texts
                    offsets = reader.image_offsets if image else reader.text_offsets
                    found = self._gathers[key] = RowGather(paths, offsets, reader.row_bytes)
        return found

    def fill(self, positions: np.ndarray, out: Mapping[str, np.ndarray]) -> Filled:
        """The rows at ``positions`` of this split into ``out``'s arrays; their keys and captions."""
        import numpy as np

        if self.whole_table:  # this split is every row: a position is its row
            rows = positions
        else:
            segment = np.searchsorted(self.segment_starts, positions, side="right") - 1
            rows = self.segment_firsts[segment] + positions - self.segment_starts[segment]
        shards = np.searchsorted(self.shard_starts, rows, side="right") - 1
        local = rows - self.shard_starts[shards]
        bounds = stretches(shards, local)
        for key, buffer in out.items():
            self._gather(key).gather(shards, local, buffer, bounds)
        fields: dict[str, Sequence[Any]] = {"key": RowKeys(self.reader.shards, shards, local)}
        if self.reader.prior.captions:
            fields["caption"] = self._batch_captions(shards, local, rows)
        return Filled(fields, dict.fromkeys(_zero_rows(out["image_embedding"]).tolist()))

    def _batch_captions(self, shards: np.ndarray, local: np.ndarray, rows: np.ndarray) -> Sequence[Any]:
        import numpy as np

        reader = self.reader
        if self._whole:
            if self._captions is None:
                import pyarrow as pa

                with self._lock, concurrent.futures.ThreadPoolExecutor(min(8, len(reader.shards))) as pool:
                    if self._captions is None:
                        columns = list(pool.map(reader.read_captions, range(len(reader.shards))))
                        self._captions = pa.concat_arrays(columns)
            return ArrowColumn(self._captions, rows)
        missing = [s for s in np.unique(shards).tolist() if s not in reader._captions]
        if len(missing) > 1:  # a shuffled batch touches every shard: its caption columns read side by side
            with concurrent.futures.ThreadPoolExecutor(min(8, len(missing))) as pool:
                list(pool.map(reader._caption_column, missing))
        captions: list[Any] = [None] * len(shards)
        for shard in np.unique(shards).tolist():
            chosen = np.flatnonzero(shards == shard)
            taken = reader._caption_column(shard).take(_arrow_indices(local[chosen])).to_pylist()
            for slot, value in zip(chosen.tolist(), taken, strict=True):
                captions[slot] = value
        return captions


def _arrow_indices(rows: np.ndarray) -> Any:
    """An int64 numpy array as an arrow array, no copy (handed a numpy array, pyarrow imports pandas: 0.3 s)."""
    import numpy as np
    import pyarrow as pa

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(rows), [None, pa.py_buffer(rows)])


def _zero_rows(batch: np.ndarray) -> np.ndarray:
    """Rows of ``batch`` whose bytes are all zero (those whose first 8 bytes are, then checked whole)."""
    import numpy as np

    octets = batch.view(np.uint8).reshape(len(batch), -1)
    if octets.shape[1] % 8 == 0:  # each row's first 8 bytes read in place, as one number
        heads = octets.view(np.uint64)[:, 0]
    else:
        head = np.zeros((len(batch), 8), np.uint8)
        head[:, : min(8, octets.shape[1])] = octets[:, :8]
        heads = head.view(np.uint64)[:, 0]
    maybe = np.flatnonzero(heads == 0)
    return maybe[~octets[maybe].any(axis=1)] if len(maybe) else maybe


def rows_fill(reader: Reader, plan: Plan) -> RowsFill | None:
    """The batch path of an embedding_table plan: local tables, else None (rows one by one)."""
    from datacat.formats.embedding_table import EmbeddingTableReader

    if not isinstance(reader, EmbeddingTableReader) or any(is_remote(url) for url in reader.images[:1]):
        return None
    return RowsFill(reader)
