"""The packed record layouts of array_record shards, byte for byte.

``packed``: entries length-prefixed in dict order, each a little-endian
uint32 key length, the utf-8 key, a uint32 value length and the value
(``jpg``/``txt``, often also ``key``/``meta``). ``pre_resized``: a packed
dict whose ``image`` is raw uint8 HxWx3 pixels and ``shape`` two
little-endian int32s (H, W), with ``caption`` and optionally ``label``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = ["pack_record", "packed_label", "unpack_pre_resized", "unpack_record", "unpack_views"]

_U32 = struct.Struct("<I")


def pack_record(entries: Mapping[str, bytes | memoryview | str]) -> bytes:
    """``entries`` length-prefixed in dict order, the layout ``unpack_record`` reads; str values become utf-8."""
    out = bytearray()
    for key, value in entries.items():
        raw_key = key.encode("utf-8")
        raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        out += _U32.pack(len(raw_key)) + raw_key + _U32.pack(len(raw)) + raw
    return bytes(out)


def unpack_record(data: bytes | memoryview) -> dict[str, bytes]:
    """The str -> bytes entries of one packed record.

    Raises ``ValueError`` saying where the record stops making sense (a length
    running past its end, a key that is not utf-8, a key given twice).
    """
    return {key: bytes(value) for key, value in unpack_views(data).items()}


def unpack_views(data: bytes | memoryview) -> dict[str, memoryview]:
    """The entries of one packed record as views of ``data`` (:func:`unpack_record`, with no value copied)."""
    view = memoryview(data)
    out: dict[str, memoryview] = {}
    pos, end = 0, len(view)
    while pos < end:
        if end - pos < 4:
            raise ValueError(f"truncated packed record: {end - pos} stray byte(s) at offset {pos}")
        (klen,) = _U32.unpack_from(view, pos)
        pos += 4
        if klen > end - pos - 4:
            raise ValueError(
                f"truncated packed record: key length {klen} at offset {pos - 4} runs past the end ({end} bytes)"
            )
        try:
            key = bytes(view[pos : pos + klen]).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"garbled packed record: key at offset {pos} is not utf-8") from None
        pos += klen
        (vlen,) = _U32.unpack_from(view, pos)
        pos += 4
        if vlen > end - pos:
            raise ValueError(f"truncated packed record: value of {key!r} needs {vlen} bytes, {end - pos} remain")
        if key in out:
            raise ValueError(f"garbled packed record: key {key!r} appears twice")
        out[key] = view[pos : pos + vlen]
        pos += vlen
    return out


def unpack_pre_resized(entries: Mapping[str, bytes] | Mapping[str, memoryview]) -> np.ndarray:
    """The uint8 HxWx3 image of a ``pre_resized`` record, checked against its ``shape``."""
    for key in ("image", "shape"):
        if key not in entries:
            raise ValueError(f"pre_resized record has no {key!r} entry (has {sorted(entries)})")
    if len(entries["shape"]) != 8:
        raise ValueError(f"pre_resized 'shape' is {len(entries['shape'])} bytes, expected two int32 (8 bytes)")
    height, width = struct.unpack("<ii", entries["shape"])
    if height <= 0 or width <= 0 or height * width * 3 != len(entries["image"]):
        raise ValueError(f"pre_resized 'image' has {len(entries['image'])} bytes, shape says {height}x{width}x3")
    import numpy as np  # imported where a shard is read: describing an entry needs none

    return np.frombuffer(entries["image"], dtype=np.uint8).reshape(height, width, 3)


def packed_label(raw: bytes) -> int:
    """A packed record's label: ascii digits, as most packers write it, else a 4- or 8-byte little-endian int."""
    text = raw.strip()
    if text and all(c in b"0123456789-" for c in text):
        return int(text)
    if len(raw) in (4, 8):
        return int.from_bytes(raw, "little", signed=True)
    raise ValueError(f"label {raw!r} is neither an integer text nor a little-endian int")
