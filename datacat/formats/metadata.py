"""Record fields: the extra keys an entry passes to its batches, and the per-shard tables joined to them by key.

img2dataset writes, beside each ``NNNNN.tar``, a ``NNNNN.parquet`` with one
row per url it tried (``key``, ``status``, ``width``, ``height``, for LAION
``aesthetic``, ``punsafe``, ...). A :class:`ShardTables` reads the columns an
entry's ``record.fields`` name from the table of each shard a record comes
from (each process keeps the last 64 shards' tables), and looks a record's
row up by its key. Rows whose download failed have no sample in the tar:
the join never meets them.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from datacat.formats.tar import decode_member
from datacat.shards import beside
from datacat.storage import open_url

__all__ = ["ShardTables", "decoded_fields", "owned", "read_table", "table_url"]

_TABLES_KEPT = 64
"""Shard tables a process keeps: a shuffled epoch draws from every shard, so a miss reads one table again."""


def table_url(shard_url: str) -> str:
    """The metadata table beside a tar shard: ``.../00012.tar`` -> ``.../00012.parquet``."""
    return beside(shard_url, ".parquet")


def decoded_fields(fields: Sequence[str], entries: Mapping[str, Any]) -> dict[str, Any]:
    """The ``fields`` of a record's raw entries (tar members or packed keys), each decoded by its name.

    ``json`` is parsed, ``txt`` read as utf-8, ``cls`` as an integer, ``npy``
    as an array; any other name stays bytes. A field the record lacks is
    left out (the table, if any, is asked next).
    """
    out: dict[str, Any] = {}
    for name in fields:
        value = entries.get(name)
        if value is None:
            continue
        out[name] = owned(decode_member(name, value)[1] if isinstance(value, bytes | memoryview) else value)
    return out


def owned(value: Any) -> Any:
    """``value`` with a view of a record's bytes copied out: a batch outlives the record, and crosses processes."""
    return bytes(value) if isinstance(value, memoryview) else value


class ShardTables:
    """The columns ``columns`` of each shard's metadata table, by the record's key.

    Picklable: worker processes read the tables they need themselves.
    """

    def __init__(
        self, name: str, columns: Sequence[str], storage_options: Mapping[str, Any], *, ordered: bool = False
    ) -> None:
        self.name = name
        self.ordered = ordered  # each row's place must be its sample's place in the tar (a selection relies on it)
        self.columns = tuple(columns)
        self.storage_options = dict(storage_options)
        self._tables: collections.OrderedDict[str, _Table] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ShardTables({self.name!r}, columns={self.columns})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tables": collections.OrderedDict(), "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def join(self, record: dict[str, Any], wanted: Sequence[str]) -> None:
        """Adds to ``record`` the ``wanted`` columns of its row in its shard's table; raises ValueError naming both."""
        if not wanted:
            return
        url = table_url(str(record["__shard__"]))
        columns, rows = self._table(url)
        absent = [name for name in wanted if name not in columns]
        if absent:
            raise ValueError(
                f"no member .{', .'.join(absent)} in the sample and no such column in {url} "
                f"(it has {', '.join(columns)}); fix record.fields of {self.name}"
            )
        key = str(record["__key__"])
        row = rows.get(key)
        if row is None:
            raise ValueError(
                f"key {key!r} has no successful row in {url} (its 'key' column): the table and the tar disagree"
            )
        if self.ordered and row[_ORDINAL] != int(record["__uid__"]) & 0xFFFFFFFF:
            raise ValueError(
                f"key {key!r} is sample {int(record['__uid__']) & 0xFFFFFFFF} of its tar but successful row "
                f"{row[_ORDINAL]} of {url}: select needs the table in the tar's order, as img2dataset writes it"
            )
        for column in wanted:
            record[column] = row[column]

    def columns_of(self, url: str) -> tuple[str, ...]:
        """The column names of the table at ``url``."""
        return self._table(url)[0]

    def _table(self, url: str) -> _Table:
        with self._lock:
            rows = self._tables.get(url)
            if rows is not None:
                self._tables.move_to_end(url)
                return rows
        rows = self._read(url)
        with self._lock:
            self._tables[url] = rows
            while len(self._tables) > _TABLES_KEPT:
                self._tables.popitem(last=False)
        return rows

    def _read(self, url: str) -> _Table:
        names, table = read_table(url, ["key", *self.columns], self.storage_options)
        if "key" not in names:
            raise ValueError(f"{url} has no 'key' column (its columns: {', '.join(names)}), which the join needs")
        data = table.to_pydict()
        columns = [c for c in self.columns if c in names]
        return names, {
            str(key): {_ORDINAL: ordinal, **{c: data[c][ordinal] for c in columns}}
            for ordinal, key in enumerate(data["key"])
        }


def read_table(url: str, columns: Sequence[str], storage_options: Mapping[str, Any]) -> tuple[tuple[str, ...], Any]:
    """A shard table's column names, and its successful rows, in order, of those of ``columns`` it has.

    Rows whose ``status`` is not ``success`` (img2dataset's failed downloads,
    which have no sample) are left out. Raises ValueError naming ``url``
    when it is not a readable parquet table.
    """
    import pyarrow.compute as pc
    import pyarrow.parquet as pq  # imported where a table is read: the catalog side needs none

    with open_url(url, storage_options) as stream:
        try:
            names = tuple(pq.read_schema(stream).names)
            stream.seek(0)
            read = [c for c in [*columns, "status"] if c in names]
            table = pq.read_table(stream, columns=list(dict.fromkeys(read)))
        except (OSError, ValueError, KeyError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"{url} is not a readable parquet table: {exc}") from None
    if "status" in names:
        table = table.filter(pc.equal(table["status"], "success"))
    return names, table


_ORDINAL = "\0ordinal"  # a row's place among the table's successful rows (no column can be named so)
_Table = tuple[tuple[str, ...], dict[str, dict[str, Any]]]
"""A shard table's column names, and its successful rows' wanted columns by key."""
