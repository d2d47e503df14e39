"""Pre-resized ArrayRecord records read a batch at a time: each record's pixels copied once, from the file to its row.

A shard written with one record a chunk and no compression (what
``datacat convert --layout pre_resized`` writes) holds each record's pixels
as plain bytes at a known place: after the chunk's 40-byte header, its
compression byte and record sizes, and the packed record's ``image`` entry
header. The only bytes in between are the 24-byte headers Riegeli puts at
every 64 KiB block boundary. So the shard is memory-mapped, the batch's
record heads are read from the map and checked together in a few numpy
calls (:func:`plain_layout`), and the pixels of a run of plain records are
copied from the map into their rows by one ``np.concatenate`` over the
pieces between block headers, which lets the GIL go for the whole copy, so
two threads fill two batches side by side. (One ``os.preadv`` a record cost
twice the CPU, most of it the kernel's copy from the page cache; a numpy
copy a piece, four an image, handed the GIL back and forth hundreds of
times a batch, and two threads filled no faster than one.) The record's other entries (shape,
caption, key, label) are read from the map as small bytes and parsed by
:func:`small_entries` (names as bytes, no error message made). Nothing is
decoded or copied again, and array_record's C++ reader is not loaded.

A record that does not look so (another image size, a compressed or
grouped shard, damaged heads) is left to the ordinary record path, which
reads it through array_record and says what is wrong with it. A shard cut
short while it is mapped would fault the process: shards are immutable
while a loader reads them, as everywhere in datacat.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from datacat.formats import Filled, Reader, check_declared, riegeli
from datacat.formats.packed import packed_label

if TYPE_CHECKING:
    import numpy as np

    from datacat.formats.array_record import ArrayRecordReader
    from datacat.plan import Plan

__all__ = ["Layout", "PreResizedFill", "plain_layout"]

log = logging.getLogger(__name__)

_HEAD = 128
"""Bytes read first from a chunk's start: its header, sizes and the record's ``image`` entry header."""
_HEAD_FIELDS = struct.Struct("<8xQ8xQQBB")
"""A chunk's header (data size, type and records, decoded size) then its data's compression byte and sizes' length."""
_ONE_RECORD = (1 << 8) | ord("r")
"""A simple chunk of one record."""
USABLE = riegeli.BLOCK - riegeli.BLOCK_HEADER
"""A block's bytes after its header: a chunk's own bytes run on across blocks this many at a time."""
_U32 = struct.Struct("<I")


class Layout(NamedTuple):
    """Where a batch's plain records lie in their files, record by record (:func:`plain_layout`)."""

    plain: list[bool]
    """Whether the record is one uncompressed record with the image first, inside its chunk."""
    pixels_at: list[int]
    """File offset of its first pixel."""
    first_run: list[int]
    """Pixels before the first block header inside them."""
    rest: list[tuple[int, int]]
    """File span of its other entries (shape, caption, key, label), block headers included where one falls inside."""


def plain_layout(heads: np.ndarray, starts: np.ndarray, ends: np.ndarray, image_head: bytes) -> Layout:
    """The layout of the records whose chunks start at file offsets ``starts`` (and stop at ``ends``), from ``heads``.

    ``heads`` is uint8 [records, ``_HEAD``]: each chunk's first bytes
    without block headers (:meth:`_Shard.head`). A record is plain when its chunk
    holds one uncompressed record of ``decoded`` bytes that starts with
    ``image_head`` and the data ends inside the chunk: checked for the batch
    in a few numpy calls.
    """
    import numpy as np

    def u64(at: int) -> np.ndarray:
        return np.ascontiguousarray(heads[:, at : at + 8]).view("<u8")[:, 0].astype(np.int64)

    data_size, type_and_count, decoded = u64(8), u64(24), u64(32)
    compression, sizes_length = heads[:, 40], heads[:, 41].astype(np.int64)
    digit = np.arange(5)
    raw = heads[:, 42:47].astype(np.int64)  # the record's size, a varint of sizes_length bytes
    used = digit < sizes_length[:, None]
    length = (((raw & 0x7F) << (7 * digit)) * used).sum(axis=1)
    varint = (~used | (((raw & 0x80) != 0) == (digit < sizes_length[:, None] - 1))).all(axis=1)
    after = _HEAD_FIELDS.size + sizes_length
    marks = heads[np.arange(len(heads))[:, None], np.minimum(after, 47)[:, None] + np.arange(len(image_head))]
    pixels = len_pixels(image_head)
    first = after + len(image_head)  # the pixels' logical offset in the chunk
    stop = 40 + data_size
    rest_length = stop - first - pixels
    within = np.maximum(
        starts % riegeli.BLOCK - riegeli.BLOCK_HEADER, 0
    )  # a chunk at a boundary starts after its header
    data = starts // riegeli.BLOCK * USABLE + within  # the chunk's start among the blocks' own bytes
    pixel_data, rest_data = data + first, data + first + pixels

    def physical(at: np.ndarray) -> np.ndarray:
        out: np.ndarray = at // USABLE * riegeli.BLOCK + riegeli.BLOCK_HEADER + at % USABLE
        return out

    rest_at = physical(rest_data)
    rest_end = np.where(rest_length > 0, physical(rest_data + rest_length - 1) + 1, rest_at)
    plain = (
        (type_and_count == _ONE_RECORD)
        & (compression == 0)
        & (sizes_length >= 1)
        & (sizes_length <= 5)
        & varint
        & (length == decoded)
        & (marks == np.frombuffer(image_head, np.uint8)).all(axis=1)
        & (stop - first == decoded - len(image_head))
        & (rest_length >= 0)
        & (physical(data + stop - 1) < ends)
    )
    return Layout(
        plain.tolist(),
        physical(pixel_data).tolist(),
        np.minimum(USABLE - pixel_data % USABLE, pixels).tolist(),
        list(zip(rest_at.tolist(), rest_end.tolist(), strict=True)),
    )


class _Shard:
    """One local shard mapped for filling: its bytes (a read-only memory map) and chunk index (one record a chunk)."""

    def __init__(self, url: str, fd: int, index: riegeli.ChunkIndex) -> None:
        self.url, self.index, self.fd = url, index, fd
        weakref.finalize(self, os.close, fd)  # the shard's descriptor lives as long as this object
        self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        # No huge page of a read-only file is mapped here (FilePmdMapped stays 0), but with this advice the
        # copies out of the map ran 8-15 % faster, side by side (2 cores, AMD, ext4; embedding rows: no change).
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
            self.map.madvise(mmap.MADV_HUGEPAGE)
        import numpy as np

        self.array = np.frombuffer(self.map, np.uint8)  # the same bytes, for numpy's copies
        self.starts = index.starts.tolist()  # plain ints: a numpy scalar a record costs more than the copy
        self.ends = index.ends.tolist()

    def head(self, position: int) -> bytes:
        """Record ``position``'s chunk's first ``_HEAD`` bytes, block headers taken out (zeros past its end)."""
        start, end = self.starts[position], self.ends[position]
        within = start % riegeli.BLOCK
        if riegeli.BLOCK_HEADER <= within <= riegeli.BLOCK - _HEAD and start + _HEAD <= end:
            return self.map[start : start + _HEAD]  # inside one block: as the file holds it
        start += max(riegeli.BLOCK_HEADER - within, 0)  # a chunk at a block boundary starts after its header
        head = riegeli.without_block_headers(self.map[start : min(start + _HEAD + riegeli.BLOCK_HEADER, end)], start)
        return head[:_HEAD].ljust(_HEAD, b"\0")

    def rest(self, span: tuple[int, int]) -> bytes:
        """The bytes of a record's other entries at file ``span``, without the block header that may fall inside."""
        first, stop = span
        raw = self.map[first:stop]
        return (
            raw if first // riegeli.BLOCK == (stop - 1) // riegeli.BLOCK else riegeli.without_block_headers(raw, first)
        )

    def pieces(self, at: int, first_run: int, pixels: int) -> list[np.ndarray]:
        """Views of the map holding ``pixels`` bytes from file offset ``at``: a block header after the first
        ``first_run`` bytes and after every ``USABLE`` bytes from there.
        """
        array = self.array
        return [array[at + begin : at + end] for begin, end in _spans(first_run, pixels)]


@functools.lru_cache(maxsize=4096)
def _spans(first_run: int, pixels: int) -> tuple[tuple[int, int], ...]:
    """Where a record's ``pixels`` bytes lie from its first pixel's offset: between the block headers after
    ``first_run`` bytes and every ``USABLE`` bytes from there (one tuple a start within a block, made once).
    """
    out, at = [(0, first_run)], first_run + riegeli.BLOCK_HEADER
    for cut in range(first_run, pixels, USABLE):
        length = min(USABLE, pixels - cut)
        out.append((at, at + length))
        at += length + riegeli.BLOCK_HEADER
    return tuple(out)


def small_entries(rest: bytes) -> dict[bytes, bytes] | None:
    """The entries of a packed record's small part (shape, caption, key, label) by utf-8 name; None if garbled.

    :func:`~datacat.formats.packed.unpack_views` parses the same layout
    and says what is wrong with a garbled record; this one only tells that
    one is, in half its time (names are checked but kept as bytes, no message is made), and
    the record path then reads the record again and names its fault.
    """
    out: dict[bytes, bytes] = {}
    pos, end = 0, len(rest)
    try:
        while pos < end:
            (name_length,) = _U32.unpack_from(rest, pos)
            name = rest[pos + 4 : pos + 4 + name_length]
            pos += 4 + name_length
            (length,) = _U32.unpack_from(rest, pos)
            pos += 4
            if pos + length > end or name in out:
                return None
            name.decode("utf-8")  # a name the record path would refuse
            out[name] = rest[pos : pos + length]
            pos += length
    except (struct.error, UnicodeDecodeError):  # a length past the end, a name not utf-8
        return None
    return out


def len_pixels(image_head: bytes) -> int:
    """The pixels' length an ``image`` entry header states."""
    return int.from_bytes(image_head[-4:], "little")


class PreResizedFill:
    """Batches of a local pre-resized ArrayRecord entry: pixels read straight into the batch's image rows."""

    def __init__(self, reader: ArrayRecordReader, plan: Plan) -> None:
        import numpy as np

        self.reader = reader
        self.size = plan.loading.image_size
        self.pixels = self.size * self.size * 3
        self.image_head = struct.pack("<I5sI", 5, b"image", self.pixels)
        self.shape = struct.pack("<ii", self.size, self.size)
        record = plan.record
        # The entries read, by name as small_entries gives them (captions as the record path reads them).
        self.caption_names = (record.caption.encode(), b"caption") if record.caption else ()
        self.label_name = (record.label or "label").encode()
        self.key_name = record.key.encode() if record.key else None
        self.names = [os.path.basename(url) for url in reader.urls]  # a record without a key is named by these
        self.offsets = np.asarray(reader.offsets, np.int64)  # each shard's first position, for the batch's searchsorted
        self._shards: dict[int, _Shard | None] = {}
        self._lock = threading.Lock()  # threads filling batches side by side open each shard once

    def threads(self, run: int) -> int:
        """Two: a batch's copy lets the GIL go, and two fill side by side in any order (no worker processes)."""
        return 2

    def __repr__(self) -> str:
        return f"PreResizedFill({self.reader.name!r}, size={self.size})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_shards": {}, "_lock": None}  # each process opens the files itself

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def arrays(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        return {"image": ((self.size, self.size, 3), "uint8")}

    def _shard(self, i: int) -> _Shard | None:
        found = self._shards.get(i, False)
        if found is not False:
            return found  # type: ignore[return-value]
        with self._lock:
            if i not in self._shards:
                self._shards[i] = self._open(i)
            return self._shards[i]

    def _open(self, i: int) -> _Shard | None:
        url = self.reader.urls[i]
        fd = os.open(url, os.O_RDONLY)
        try:
            index = _local_index(fd, url)
            if index is not None:
                check_declared([url], [self.reader.counts[i]], [len(index)], kind="ArrayRecord shard ")
        except BaseException:
            os.close(fd)
            raise
        if index is None or not bool((index.records == 1).all()) or not _uncompressed(fd, index):
            os.close(fd)
            log.info(
                "%s: its records are compressed, grouped or transposed, so they are read one by one; "
                "`datacat convert --layout pre_resized` writes shards read straight into the batch",
                url,
            )
            return None
        return _Shard(url, fd, index)  # it keeps the descriptor

    def fill(self, positions: np.ndarray, out: Mapping[str, np.ndarray]) -> Filled:
        """Pixels of the records at ``positions`` into ``out["image"]``; their keys, captions and labels."""
        images = out["image"]
        if images.shape[1:] != (self.size, self.size, 3) or images.dtype != "uint8" or not images.flags.c_contiguous:
            raise ValueError(f"{self!r} fills C-contiguous uint8 [n, {self.size}, {self.size}, 3], not {images.shape}")
        import numpy as np

        names, pixels, no_head = self.names, self.pixels, bytes(_HEAD)
        offsets = self.offsets
        shard_of = np.searchsorted(offsets, positions, side="right") - 1
        where = list(zip(shard_of.tolist(), (positions - offsets[shard_of]).tolist(), strict=True))
        opened = [self._shard(shard) for shard, _ in where]
        heads, starts, ends = [], [], []  # every record's heads, checked for the batch at once
        for shard, (_, local) in zip(opened, where, strict=True):
            heads.append(no_head if shard is None else shard.head(local))
            starts.append(0 if shard is None else shard.starts[local])
            ends.append(0 if shard is None else shard.ends[local])
        layout = plain_layout(
            np.frombuffer(b"".join(heads), np.uint8).reshape(len(heads), _HEAD),
            np.asarray(starts, np.int64),
            np.asarray(ends, np.int64),
            self.image_head,
        )
        keys: list[Any] = []
        captions: list[Any] = []
        labels: list[Any] = []
        left: dict[int, Exception | None] = {}
        # The pixels of each run of plain records are copied by one numpy call (the GIL let go for all of it).
        rows, pieces, run = images.reshape(-1), [], 0
        for slot, ((shard, local), found) in enumerate(zip(where, opened, strict=True)):
            rest: bytes | None = None
            if found is not None and layout.plain[slot]:
                pieces += found.pieces(layout.pixels_at[slot], layout.first_run[slot], pixels)
                rest = found.rest(layout.rest[slot])
            else:  # not plain: the record path reads it into its row
                if pieces:
                    np.concatenate(pieces, out=rows[run * pixels : slot * pixels])
                pieces, run = [], slot + 1
            key = caption = label = None
            if rest is not None:
                try:
                    entries = small_entries(rest)
                    if entries is None or entries.get(b"shape") != self.shape:
                        raise ValueError("not this size")
                    for name in self.caption_names:  # as record_caption reads it
                        if name in entries:
                            caption = str(entries[name], "utf-8").strip()
                            break
                    if self.label_name in entries:
                        label = packed_label(entries[self.label_name])
                    if self.key_name is not None and self.key_name in entries:
                        key = str(entries[self.key_name], "utf-8", "replace")
                except ValueError:  # UnicodeDecodeError too: the record path reads it again and says what is wrong
                    rest = None
            if rest is None:
                left[slot] = None
            keys.append(key if key is not None else f"{names[shard]}:{local}")
            captions.append(caption)
            labels.append(label)
        if pieces:
            np.concatenate(pieces, out=rows[run * pixels :])
        return Filled({"key": keys, "caption": captions, "label": labels}, left)


def _local_index(fd: int, url: str) -> riegeli.ChunkIndex | None:
    """The chunk index of an open local shard from its footer; None if its chunks are transposed."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, riegeli.tail_size(size), size - riegeli.tail_size(size))
    try:
        try:
            return riegeli.read_index(tail, size)
        except riegeli.NeedMore as more:
            return riegeli.read_index(tail, size, os.pread(fd, size - len(tail) - more.offset, more.offset))
    except riegeli.Unsupported:
        return None
    except ValueError:  # not readable here: the record path opens it and names what is wrong
        return None


def _uncompressed(fd: int, index: riegeli.ChunkIndex) -> bool:
    # The first record chunk's compression byte; a shard is written with one compression throughout.
    if not len(index.starts):
        return False
    start = int(index.starts[0])
    head = riegeli.without_block_headers(os.pread(fd, _HEAD, start), start)
    return len(head) > 40 and head[40] == 0


def pre_resized_fill(reader: Reader, plan: Plan) -> PreResizedFill | None:
    """The batch path of an array_record plan: local pre-resized shards, else None (records one by one)."""
    from datacat.formats.array_record import ArrayRecordReader

    if not isinstance(reader, ArrayRecordReader) or reader.remote or plan.record.layout != "pre_resized":
        return None
    return PreResizedFill(reader, plan)
