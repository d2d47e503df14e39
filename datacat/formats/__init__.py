"""Readers: shards to raw records, one module per ``format:`` value.

Each module ends in the format's declaration (:class:`datacat.registry.Format`)
and holds its reader, which keeps one of the two contracts the registry
states (:class:`~datacat.registry.RandomAccessReader`,
:class:`~datacat.registry.StreamReader`; grain's ``RandomAccessDataSource``
states the same for its sources). They are re-exported here with the
helpers readers share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from datacat.errors import BackendUnavailable, ShardError
from datacat.registry import BatchFill, Filled, RandomAccessReader, RawItem, Reader, StreamReader, format_of

if TYPE_CHECKING:
    from datacat.plan import Plan

__all__ = [
    "BatchFill",
    "Filled",
    "RandomAccessReader",
    "RawItem",
    "Reader",
    "StreamReader",
    "check_declared",
    "count_shard",
    "only_item",
    "open_reader",
    "record_caption",
]


def only_item(results: Sequence[RawItem | Exception]) -> RawItem:
    """The one item of a reader's ``items([index])``, its error raised."""
    (result,) = results
    if isinstance(result, Exception):
        raise result
    return result


def check_declared(
    urls: Sequence[str],
    declared: Sequence[int | None],
    found: Sequence[int],
    *,
    kind: str = "",
    holds: str = "has {} records",
) -> None:
    """Raises a ShardError for the first shard whose record count differs from what its entry declares.

    The message reads ``{kind}{url} {holds}``, e.g. ``tar shard x.tar holds 6 samples``.
    """
    for url, expected, actual in zip(urls, declared, found, strict=True):
        if expected is not None and expected != actual:
            raise ShardError(
                f"{kind}{url} {holds.format(actual)}, the catalog declares {expected}: the shard is damaged or the "
                "entry is wrong; re-copy the shard or correct totals.per_shard",
                url=url,
            )


def open_reader(plan: Plan) -> Reader:
    """The reader of ``plan``'s format; a library it needs and lacks is named with its install command."""
    declared = format_of(plan.format)
    try:
        reader: Reader = declared.reader(plan)
    except ImportError as exc:
        if declared.hint and exc.name and not exc.name.startswith("datacat"):
            raise BackendUnavailable(f"{declared.hint} ({exc.name} is not installed)") from exc
        raise
    return reader


def count_shard(reader: Reader, shard: int) -> int:
    """Records in one shard: known to a random-access reader, counted by reading (nothing decoded) otherwise."""
    if reader.random_access:
        return int(reader.counts[shard])
    return sum(1 for _ in reader.iter_shard(shard))


def record_caption(fields: Mapping[str, Any], keys: Sequence[str] = ("txt", "caption", "text")) -> str | None:
    """The caption a record already carries, from the first of ``keys`` it has, or None."""
    for key in keys:
        value = fields.get(key)
        if value is None:
            continue
        if isinstance(value, bytes | memoryview):
            try:
                value = str(value, "utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"caption {key!r} is not utf-8") from None
        return str(value).strip()
    return None
