"""ArrayRecord's layout read in Python: the chunk index from the footer, and a chunk's records from its bytes.

array_record's own C++ client reads a remote record with an open-ended
range (``bytes=N-``) and drops the connection once it has its chunk: a new
connection, and a server streaming bytes nobody reads, for every record.
With the chunk offsets known, a record is one exact range through fsspec
(concurrent, retried, under the read deadline like every other read here).

The layout, from the Riegeli records format and array_record's
``layout.proto``: the file is 64 KiB blocks, each starting with a 24-byte
block header that may interrupt a chunk; a chunk is a 40-byte header and
its data. The last block holds a ``RiegeliPostscript`` (footer offset,
magic); the footer chunk before it holds a ``RiegeliFooterMetadata`` and
one ``ArrayRecordFooter`` (chunk offset, records) per chunk. Simple chunks
(``r``) uncompressed or zstd are decoded here; a transposed chunk, or
brotli or snappy compression, is ``Unsupported`` and the caller falls back
to the C++ reader. Riegeli's HighwayHash checksums are not recomputed: a
damaged chunk shows as sizes that do not add up or a zstd frame that does
not decode.
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any

from datacat.formats.wire import fields, varint

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "BLOCK",
    "BLOCK_HEADER",
    "ChunkIndex",
    "Unsupported",
    "chunk_header",
    "decode_chunk",
    "read_index",
    "tail_size",
    "without_block_headers",
]

BLOCK = 1 << 16
BLOCK_HEADER = 24
_CHUNK_HEADER = 40
_MAGIC = 0x71930E704FDAE05E
_TAIL = 1 << 20
"""Bytes read from a shard's end for its index: the postscript block and, for up to ~80k chunks, the footer."""


class Unsupported(ValueError):
    """A chunk this module does not decode (transposed, brotli, snappy): read it with the C++ reader."""


class ChunkIndex:
    """Where each chunk of one shard starts and how many records it holds; ``ends[i]`` is where chunk i stops."""

    def __init__(self, starts: np.ndarray, records: np.ndarray, footer: int) -> None:
        import numpy as np  # numpy is imported where a shard is read: describing an entry needs none

        self.starts = starts
        self.records = records
        self.ends = np.append(starts[1:], footer)
        self.first = np.concatenate(([0], np.cumsum(records)))  # first record of each chunk, and the total

    def __len__(self) -> int:
        return int(self.first[-1])

    def locate(self, position: int) -> tuple[int, int]:
        """(chunk, record within it) of the shard's record ``position``."""
        chunk = int(self.first.searchsorted(position, side="right")) - 1
        return chunk, position - int(self.first[chunk])

    def to_array(self) -> np.ndarray:
        """int64 [chunks + 1, 2]: (start, records) per chunk, then (footer offset, 0)."""
        import numpy as np

        rows = np.stack([self.starts, self.records], axis=1)
        return np.concatenate([rows, [[self.ends[-1] if len(self.ends) else 0, 0]]]).astype(np.int64)

    @classmethod
    def from_array(cls, array: np.ndarray) -> ChunkIndex:
        return cls(array[:-1, 0], array[:-1, 1], int(array[-1, 0]))


def tail_size(size: int) -> int:
    """How many bytes from the end of a ``size``-byte shard to read first."""
    return min(size, _TAIL)


def read_index(tail: bytes, size: int, more: bytes = b"") -> ChunkIndex:
    """The chunk index of a ``size``-byte shard from its last ``len(tail)`` bytes.

    Raises ``NeedMore`` (a ``ValueError``) with the footer offset when the
    footer starts before the tail; call again with ``more`` holding the
    bytes from that offset up to the tail.
    """
    if size < BLOCK or len(tail) < BLOCK:
        raise ValueError(f"{size} bytes is shorter than an ArrayRecord file (a 64 KiB postscript block at least)")
    # The writer repeats the postscript; the reader takes the first.
    postscripts = [bytes(r) for r in decode_chunk(tail[-BLOCK:], size - BLOCK)]
    postscript = _proto_varints(postscripts[0]) if postscripts else {}
    footer, magic = postscript.get(1), postscript.get(2)
    if footer is None or magic != _MAGIC:
        raise ValueError("no ArrayRecord postscript in the last block (not an ArrayRecord file, or truncated)")
    have = size - len(tail) - len(more)
    if footer < have:
        raise NeedMore(footer)
    buffer = (more + tail)[footer - have : len(more) + len(tail) - BLOCK]
    records = [bytes(r) for r in decode_chunk(buffer, footer)]
    metadata = _proto_varints(records[0]).get(1) if records else None  # RiegeliFooterMetadata.array_record_metadata
    if not isinstance(metadata, bytes) or _proto_varints(metadata).get(1) != 1:  # its version
        raise ValueError("the footer chunk holds no ArrayRecord metadata of version 1")
    options = _proto_varints(metadata).get(4, b"")  # the writer's options, e.g. "group_size:1,transpose:false,zstd:3"
    if b"transpose:true" in options:
        raise Unsupported("its chunks are transposed")
    starts, counts = [], []
    for record in records[1:]:
        entry = _proto_varints(record)
        if 1 not in entry:
            raise ValueError("a footer entry has no chunk offset")
        starts.append(entry[1])
        counts.append(entry.get(3, 0))
    import numpy as np

    return ChunkIndex(np.array(starts, dtype=np.int64), np.array(counts, dtype=np.int64), footer)


class NeedMore(ValueError):
    """The footer begins before the bytes given: ``offset`` is where it starts."""

    def __init__(self, offset: int) -> None:
        super().__init__(f"the footer starts at {offset}, before the bytes read")
        self.offset = offset


def decode_chunk(data: bytes, start: int) -> list[bytes | memoryview]:
    """The records of the chunk whose bytes (block headers included) are ``data``, read from file offset ``start``.

    An uncompressed record is a view of ``data`` (or of its copy without
    block headers): nothing is copied for it.
    """
    body = without_block_headers(data, start)
    if len(body) < _CHUNK_HEADER:
        raise ValueError(f"a chunk at {start} is cut short ({len(body)} bytes)")
    data_size, chunk_type, num_records, decoded_size = chunk_header(body)
    payload = memoryview(body)[_CHUNK_HEADER : _CHUNK_HEADER + data_size]  # views: a chunk is copied once, here
    if len(payload) != data_size:
        raise ValueError(f"the chunk at {start} declares {data_size} bytes of data, {len(payload)} are there")
    if chunk_type in (b"s", b"p"):  # signature, padding: no records
        return []
    if chunk_type != b"r":
        raise Unsupported(f"chunk type {chunk_type!r} at {start} (transposed or metadata): not decoded here")
    compression = payload[0]
    sizes_length, at = varint(payload, 1)
    sizes = _decompress(compression, payload[at : at + sizes_length])
    values = _decompress(compression, payload[at + sizes_length :])
    lengths, pos = [], 0
    for _ in range(num_records):
        length, pos = varint(sizes, pos)
        lengths.append(length)
    if pos != len(sizes) or sum(lengths) != decoded_size or len(values) != decoded_size:
        raise ValueError(f"the chunk at {start} does not add up: its record sizes disagree with its data")
    if len(lengths) == 1:
        return [values]  # one record a chunk (group_size:1, what grain asks for): the decoded bytes are it
    out: list[bytes | memoryview] = []
    pos = 0
    view = memoryview(values)
    for length in lengths:
        out.append(view[pos : pos + length])
        pos += length
    return out


def chunk_header(body: bytes) -> tuple[int, bytes, int, int]:
    """(data size, chunk type, records, decoded data size) from a chunk's 40-byte header."""
    _, data_size, _, type_and_count, decoded_size = struct.unpack_from("<QQQQQ", body)
    return data_size, bytes([type_and_count & 0xFF]), type_and_count >> 8, decoded_size


def without_block_headers(data: bytes, start: int) -> bytes:
    """``data``, read from file offset ``start``, without the block headers it holds."""
    first = -start % BLOCK  # offset in ``data`` of the first block boundary
    if first >= len(data):
        return data
    view = memoryview(data)
    pieces = [view[:first]]
    for boundary in range(first, len(data), BLOCK):
        pieces.append(view[boundary + BLOCK_HEADER : boundary + BLOCK])
    return b"".join(pieces)


_ZSTD = threading.local()  # a decompressor is reused (its context costs ~20 us to make) but not shared between threads


def _decompress(compression: int, block: memoryview) -> bytes | memoryview:
    if compression == 0:
        return block
    size, at = varint(block, 0)
    if compression == ord("z"):
        decompressor = getattr(_ZSTD, "decompressor", None)
        if decompressor is None:
            import zstandard

            decompressor = _ZSTD.decompressor = zstandard.ZstdDecompressor()
        out: bytes = decompressor.decompress(block[at:], max_output_size=size)
        if len(out) != size:
            raise ValueError(f"a zstd block decoded to {len(out)} bytes, {size} declared")
        return out
    raise Unsupported(f"compression {chr(compression)!r} is not decoded here")


def _proto_varints(message: bytes) -> dict[int, Any]:
    """The fields of a protobuf message by field number (the last of a repeated one)."""
    return dict(fields(message))
