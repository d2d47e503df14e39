"""Readers: shards to raw records, one module per ``format:`` value.

The contract every reader keeps (grain's ``RandomAccessDataSource`` states
the same for its sources):

- It is built from a :class:`~datacat.resolve.Plan` alone and is picklable,
  so worker processes get copies; nothing is opened until first read.
- Reading is deterministic for a given shard and position.
- ``parse(item)`` turns a raw item into the record dict of
  :mod:`datacat.transforms.sample` and raises ``ValueError`` for a record that
  cannot be read, which the bad-sample policy handles; a shard that cannot
  be opened raises :class:`~datacat.errors.ShardError` (or
  ``FileNotFoundError``) naming it.
- Stream readers (``access == "stream"``) give ``iter_shard(i)``; random
  access readers (and tar readers whose shards are indexed) give
  ``__len__``, ``item(i)`` and ``items(indices)`` as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from datacat.errors import ShardError
from datacat.registry import FORMATS, load_implementation
from datacat.resolve import Plan

__all__ = ["RawItem", "check_declared", "only_item", "open_reader", "record_caption"]


@dataclasses.dataclass(frozen=True, slots=True)
class RawItem:
    """One record as read, before parsing: where it came from and its bytes or members."""

    key: str
    shard: str
    uid: int
    payload: Any


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


def open_reader(plan: Plan) -> Any:
    """The reader for ``plan.format``, its module imported now."""
    return load_implementation(FORMATS[plan.format])(plan)


def record_caption(fields: Mapping[str, Any], keys: Sequence[str] = ("txt", "caption", "text")) -> str | None:
    """The caption a record already carries, from the first of ``keys`` it has, or None."""
    for key in keys:
        value = fields.get(key)
        if value is None:
            continue
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"caption {key!r} is not utf-8") from None
        return str(value).strip()
    return None
