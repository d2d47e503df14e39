"""The protobuf wire format, read without generated classes: ArrayRecord footers and tf.train.Example records."""

from __future__ import annotations

__all__ = ["fields", "varint"]


def varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The unsigned varint at ``pos`` and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("a protobuf varint runs past its buffer (a truncated record?)")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def fields(message: bytes) -> list[tuple[int, bytes | int]]:
    """(field number, value) of each field in order: bytes when length-delimited, an int for varint and fixed32.

    fixed64 fields are skipped (none of the messages read here has one).
    """
    out: list[tuple[int, bytes | int]] = []
    pos = 0
    while pos < len(message):
        tag, pos = varint(message, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = varint(message, pos)
            out.append((number, value))
        elif wire == 2:
            length, pos = varint(message, pos)
            if pos + length > len(message):
                raise ValueError("a protobuf field runs past its message's end (a truncated record?)")
            out.append((number, message[pos : pos + length]))
            pos += length
        elif wire == 5:
            if pos + 4 > len(message):
                raise ValueError("a protobuf field runs past its message's end (a truncated record?)")
            out.append((number, int.from_bytes(message[pos : pos + 4], "little")))
            pos += 4
        elif wire == 1:
            pos += 8
        else:
            raise ValueError(f"protobuf wire type {wire}: not a message this reader knows")
    if pos != len(message):
        raise ValueError("a protobuf message runs past its end")
    return out
