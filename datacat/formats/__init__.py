"""Readers: shards to raw records, one module per ``format:`` value.

Each module ends in the format's declaration (:class:`datacat.registry.Format`)
and holds its reader, which keeps one of the two contracts below (grain's
``RandomAccessDataSource`` states the same for its sources).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from datacat.errors import BackendUnavailable, ShardError
from datacat.registry import format_of

if TYPE_CHECKING:
    from datacat.plan import Plan

__all__ = [
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


@dataclasses.dataclass(frozen=True, slots=True)
class RawItem:
    """One record as read, before parsing: where it came from and its bytes or members.

    Bytes may be a ``memoryview`` of what was read (a record or member is
    not copied out of its span); ``bytes(payload)`` makes a copy.
    """

    key: str
    shard: str
    uid: int
    payload: Any


class RandomAccessReader(Protocol):
    """Raw records by global index: shards in plan order, records in shard order.

    - Built from a :class:`~datacat.resolve.Plan` alone and picklable, so
      worker processes get copies; what it opens is opened again in each.
    - ``len(reader)`` and ``counts`` (records per shard) are known once it is
      built; ``items(indices)`` gives the same bytes for the same index in any
      process, in the order asked, reading a batch's records at once.
    - A record that cannot be read is its ``RecordError`` (a ``ValueError``,
      judged by the bad-sample policy) or storage error in its place in the
      list; a shard that cannot be opened (or holds another count than the
      entry declares) raises a ``ShardError`` or ``FileNotFoundError`` naming it.
    - ``parse(item)`` turns a raw item into the record dict of
      :mod:`datacat.transforms.sample` and raises ``ValueError`` for a
      record that cannot be read.
    """

    @property
    def random_access(self) -> Literal[True]: ...

    @property
    def counts(self) -> Sequence[int]: ...

    def __len__(self) -> int: ...

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]: ...

    def parse(self, item: RawItem) -> dict[str, Any]: ...


class StreamReader(Protocol):
    """Raw records shard by shard, front to back (gzip tars, embedding folders beside tars).

    - Built from a Plan alone and picklable, as a random-access reader.
    - ``iter_shard(i)`` yields shard ``i``'s records in the same order every
      time; a shard that cannot be opened raises a ``ShardError`` (or
      ``FileNotFoundError``) naming it, a record that cannot be split out
      a ``RecordError``. ``counts`` are the records per shard when known
      without reading (a manifest), else empty: the loader then needs the
      entry's ``per_shard``.
    - ``parse(item)`` as for a random-access reader.
    """

    @property
    def random_access(self) -> Literal[False]: ...

    @property
    def counts(self) -> Sequence[int]: ...

    def iter_shard(self, shard: int) -> Iterator[RawItem]: ...

    def parse(self, item: RawItem) -> dict[str, Any]: ...


Reader = RandomAccessReader | StreamReader
"""What a format's reader is: ``reader.random_access`` tells which."""


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
