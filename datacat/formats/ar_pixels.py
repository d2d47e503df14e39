"""Pre-resized ArrayRecord records read a batch at a time: each record's pixels copied once, from the file to its row.

A shard written with one record a chunk and no compression (what
``datacat convert --layout pre_resized`` writes) holds each record's pixels
as plain bytes at a known place: after the chunk's 40-byte header, its
compression byte and record sizes, and the packed record's ``image`` entry
header. The only bytes in between are the 24-byte headers Riegeli puts at
every 64 KiB block boundary. So the shard is memory-mapped, each record's
heads are read from the map and checked, and its pixels are read straight
into the batch's row by one ``os.preadv`` a record, the block headers in
between landing in a scratch buffer (the GIL is let go for the call; two
threads copy at twice one's rate, where two threads copying from the map
with ``ctypes.memmove`` ran slower than one); the record's other entries
(shape, caption, key, label) are read from the map as small bytes. Nothing
is decoded or copied again, and array_record's C++ reader is not loaded.

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
from typing import TYPE_CHECKING, Any

from datacat.formats import Filled, Reader, check_declared, record_caption, riegeli
from datacat.formats.packed import packed_label, unpack_views
from datacat.formats.wire import varint

if TYPE_CHECKING:
    import numpy as np

    from datacat.formats.array_record import ArrayRecordReader
    from datacat.plan import Plan

__all__ = ["PreResizedFill", "physical_pieces"]

log = logging.getLogger(__name__)

_HEAD = 128
"""Bytes read first from a chunk's start: its header, sizes and the record's ``image`` entry header."""
_HEAD_FIELDS = struct.Struct("<8xQ8xQQBB")
"""A chunk's header (data size, type and records, decoded size) then its data's compression byte and sizes' length."""
_ONE_RECORD = (1 << 8) | ord("r")
"""A simple chunk of one record."""


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


class _Shard:
    """One local shard mapped for filling: its bytes (a read-only memory map) and chunk index (one record a chunk)."""

    def __init__(self, url: str, fd: int, index: riegeli.ChunkIndex) -> None:
        self.url, self.index, self.fd = url, index, fd
        weakref.finalize(self, os.close, fd)  # the shard's descriptor lives as long as this object
        self.map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        self._gap = bytearray(riegeli.BLOCK_HEADER)  # where the block headers between pixel runs are read to
        self.starts = index.starts.tolist()  # plain ints: a numpy scalar a record costs more than the copy
        self.ends = index.ends.tolist()

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

    threads = 2  # each record's read lets the GIL go: two batches fill side by side, no worker processes

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
        flat = memoryview(images.data).cast("B")  # C-contiguous: the rows one after another
        keys: list[Any] = []
        captions: list[Any] = []
        labels: list[Any] = []
        left: dict[int, Exception | None] = {}
        reader = self.reader
        for slot, position in enumerate(positions.tolist()):
            shard, local = reader.locate(position)
            opened = self._shard(shard)
            rest = (
                None
                if opened is None
                else opened.read(local, flat[slot * self.pixels : (slot + 1) * self.pixels], self.image_head)
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
