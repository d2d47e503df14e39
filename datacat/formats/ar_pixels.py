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
caption, key, label) are read from the map as small bytes. Nothing is
decoded or copied again, and array_record's C++ reader is not loaded.

A record that does not look so (another image size, a compressed or
grouped shard, damaged heads) is left to the ordinary record path, which
reads it through array_record and says what is wrong with it. A shard cut
short while it is mapped would fault the process: shards are immutable
while a loader reads them, as everywhere in datacat.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from datacat.formats import Filled, Reader, check_declared, record_caption, riegeli
from datacat.formats.packed import packed_label, unpack_views
from datacat.formats.wire import varint

if TYPE_CHECKING:
    import numpy as np

    from datacat.formats.array_record import ArrayRecordReader
    from datacat.plan import Plan

__all__ = ["Layout", "PreResizedFill", "physical_pieces", "plain_layout"]

log = logging.getLogger(__name__)

_HEAD = 128
"""Bytes read first from a chunk's start: its header, sizes and the record's ``image`` entry header."""
_HEAD_FIELDS = struct.Struct("<8xQ8xQQBB")
"""A chunk's header (data size, type and records, decoded size) then its data's compression byte and sizes' length."""
_ONE_RECORD = (1 << 8) | ord("r")
"""A simple chunk of one record."""
USABLE = riegeli.BLOCK - riegeli.BLOCK_HEADER
"""A block's bytes after its header: a chunk's own bytes run on across blocks this many at a time."""


def physical_pieces(start: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """(file offset, length) runs holding logical bytes ``[lo, hi)`` of the chunk at file offset ``start``.

    Logical bytes are a chunk's own; the file interleaves a 24-byte block
    header at every 64 KiB boundary, so consecutive runs are 24 bytes apart.
    """
    out: list[tuple[int, int]] = []
    pos, logical = start, 0
    if pos % riegeli.BLOCK < riegeli.BLOCK_HEADER:
        pos += riegeli.BLOCK_HEADER - pos % riegeli.BLOCK
    while logical < hi:
        boundary = (pos // riegeli.BLOCK + 1) * riegeli.BLOCK
        run = min(boundary - pos, hi - logical)
        first = max(lo, logical)
        if logical + run > first:
            out.append((pos + first - logical, logical + run - first))
        logical += run
        pos += run
        if pos == boundary:
            pos += riegeli.BLOCK_HEADER
    return out


class Layout(NamedTuple):
    """Where a batch's plain records lie in their files, record by record (:func:`plain_layout`)."""

    plain: list[bool]
    """Whether the record is one uncompressed record with the image first and its other entries inside one block."""
    pixels_at: list[int]
    """File offset of its first pixel."""
    first_run: list[int]
    """Pixels before the first block header inside them."""
    rest: list[tuple[int, int]]
    """File span of its other entries (shape, caption, key, label)."""


def plain_layout(heads: np.ndarray, starts: np.ndarray, ends: np.ndarray, image_head: bytes) -> Layout:
    """The layout of the records whose chunks start at file offsets ``starts`` (and stop at ``ends``), from ``heads``.

    ``heads`` is uint8 [records, ``_HEAD``]: each chunk's first bytes, as
    the file holds them (inside one block). A record is plain when its chunk
    holds one uncompressed record of ``decoded`` bytes that starts with
    ``image_head`` and the data ends inside the chunk, the checks
    :meth:`_Shard.read` makes one record at a time, here for the batch in a
    few numpy calls.
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
    data = starts // riegeli.BLOCK * USABLE + starts % riegeli.BLOCK - riegeli.BLOCK_HEADER  # in the blocks' bytes
    pixel_data, rest_data = data + first, data + first + pixels

    def physical(at: np.ndarray) -> np.ndarray:
        out: np.ndarray = at // USABLE * riegeli.BLOCK + riegeli.BLOCK_HEADER + at % USABLE
        return out

    rest_at = physical(rest_data)
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
        & (rest_data % USABLE + rest_length <= USABLE)
        & (physical(data + stop - 1) < ends)
    )
    return Layout(
        plain.tolist(),
        physical(pixel_data).tolist(),
        np.minimum(USABLE - pixel_data % USABLE, pixels).tolist(),
        list(zip(rest_at.tolist(), (rest_at + rest_length).tolist(), strict=True)),
    )


class _Shard:
    """One local shard mapped for filling: its bytes (a read-only memory map) and chunk index (one record a chunk)."""

    def __init__(self, url: str, fd: int, index: riegeli.ChunkIndex) -> None:
        self.url, self.index, self.fd = url, index, fd
        weakref.finalize(self, os.close, fd)  # the shard's descriptor lives as long as this object
        self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        import numpy as np

        self.array = np.frombuffer(self.map, np.uint8)  # the same bytes, for numpy's copies
        self._gap = bytearray(riegeli.BLOCK_HEADER)  # where the block headers between pixel runs are read to
        self.starts = index.starts.tolist()  # plain ints: a numpy scalar a record costs more than the copy
        self.ends = index.ends.tolist()

    def head(self, position: int) -> bytes | None:
        """Record ``position``'s first ``_HEAD`` bytes, when they lie inside one block (else None: :meth:`read` it)."""
        start = self.starts[position]
        if riegeli.BLOCK_HEADER <= start % riegeli.BLOCK <= riegeli.BLOCK - _HEAD and start + _HEAD <= len(self.map):
            return self.map[start : start + _HEAD]
        return None

    def pieces(self, at: int, first_run: int, pixels: int) -> list[np.ndarray]:
        """Views of the map holding ``pixels`` bytes from file offset ``at``: a block header after the first
        ``first_run`` bytes and after every ``USABLE`` bytes from there.
        """
        array = self.array
        out = [array[at : at + first_run]]
        at += first_run + riegeli.BLOCK_HEADER
        for cut in range(first_run, pixels, USABLE):
            length = min(USABLE, pixels - cut)
            out.append(array[at : at + length])
            at += length + riegeli.BLOCK_HEADER
        return out

    def read(self, position: int, row: memoryview, image_head: bytes) -> bytes | None:
        """Reads record ``position``'s pixels into ``row``; its other entries' bytes, or None if it is not plain.

        ``image_head`` is the packed ``image`` entry's header the record must
        start with (key length 5, ``image``, the pixels' length).
        """
        start, end = self.starts[position], self.ends[position]
        within = start % riegeli.BLOCK
        if riegeli.BLOCK_HEADER <= within <= riegeli.BLOCK - _HEAD:  # the heads lie inside one block
            head = self.map[start : start + _HEAD]
        else:
            head = riegeli.without_block_headers(self.map[start : min(start + _HEAD, end)], start)
        if len(head) < _HEAD_FIELDS.size:
            return None
        data_size, type_and_count, decoded, compression, sizes_length = _HEAD_FIELDS.unpack_from(head)
        if type_and_count != _ONE_RECORD or compression or not 0 < sizes_length <= 5:  # one record, uncompressed
            return None
        record_length, after = varint(head, _HEAD_FIELDS.size)
        if after - _HEAD_FIELDS.size != sizes_length or record_length != decoded:
            return None
        first = after + len(image_head)  # the pixels' logical offset in the chunk
        if head[after:first] != image_head:
            return None
        pixels = len_pixels(image_head)
        stop = 40 + data_size
        pieces = physical_pieces(start, first, stop)
        if stop - first != decoded - len(image_head) or pieces[-1][0] + pieces[-1][1] > end:
            return None
        if len(row) != pixels:
            return None
        done, rest = 0, []
        buffers: list[memoryview | bytearray] = []
        for offset, length in pieces:
            if done < pixels:  # the pixels' runs, a block header between two
                take = min(length, pixels - done)
                if buffers:
                    buffers.append(self._gap)
                buffers.append(row[done : done + take])
                done += take
                offset, length = offset + take, length - take
            if length:
                rest.append(self.map[offset : offset + length])
        wanted = pixels + (len(buffers) // 2) * len(self._gap)
        if os.preadv(self.fd, buffers, pieces[0][0]) != wanted:  # the GIL is let go for the read
            return None
        return b"".join(rest)


def len_pixels(image_head: bytes) -> int:
    """The pixels' length an ``image`` entry header states."""
    return int.from_bytes(image_head[-4:], "little")


class PreResizedFill:
    """Batches of a local pre-resized ArrayRecord entry: pixels read straight into the batch's image rows."""

    def __init__(self, reader: ArrayRecordReader, plan: Plan) -> None:
        self.reader = reader
        self.size = plan.loading.image_size
        self.pixels = self.size * self.size * 3
        self.image_head = struct.pack("<I5sI", 5, b"image", self.pixels)
        self.shape = struct.pack("<ii", self.size, self.size)
        record = plan.record
        self.caption_keys: tuple[str, ...] = (record.caption, "caption") if record.caption else ()
        self.label_key = record.label or "label"
        self.key_key = record.key
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

        flat = memoryview(images.data).cast("B")  # C-contiguous: the rows one after another
        reader, pixels, no_head = self.reader, self.pixels, bytes(_HEAD)
        offsets = np.asarray(reader.offsets)
        shard_of = np.searchsorted(offsets, positions, side="right") - 1
        where = list(zip(shard_of.tolist(), (positions - offsets[shard_of]).tolist(), strict=True))
        opened = [self._shard(shard) for shard, _ in where]
        # Every record's heads, checked for the batch at once; a record whose heads cross a block is read alone.
        heads, starts, ends = [], [], []
        for shard, (_, local) in zip(opened, where, strict=True):
            heads.append(no_head if shard is None else shard.head(local) or no_head)
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
            rest: bytes | None
            if found is not None and layout.plain[slot]:
                pieces += found.pieces(layout.pixels_at[slot], layout.first_run[slot], pixels)
                rest = found.map[layout.rest[slot][0] : layout.rest[slot][1]]
            else:  # heads or other entries across a block boundary, or not plain at all (read says which)
                if pieces:
                    np.concatenate(pieces, out=rows[run * pixels : slot * pixels])
                pieces, run = [], slot + 1
                rest = (
                    None
                    if found is None
                    else found.read(local, flat[slot * pixels : (slot + 1) * pixels], self.image_head)
                )
            key = caption = label = None
            if rest is not None:
                try:
                    entries = unpack_views(rest)
                    if bytes(entries.get("shape", b"")) != self.shape:
                        raise ValueError("not this size")
                    caption = record_caption(entries, self.caption_keys) if self.caption_keys else None
                    if self.label_key in entries:
                        label = packed_label(bytes(entries[self.label_key]))
                    if self.key_key and self.key_key in entries:
                        key = str(entries[self.key_key], "utf-8", "replace")
                except ValueError:  # UnicodeDecodeError too: the record path reads it again and says what is wrong
                    rest = None
            if rest is None:
                left[slot] = None
            keys.append(key if key is not None else f"{os.path.basename(reader.urls[shard])}:{local}")
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
