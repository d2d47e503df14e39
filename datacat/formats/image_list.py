"""Tables (CSV, TSV, parquet) listing image paths with an optional caption column.

As in the VQGAN batch-encoding example: a TSV of absolute paths, no header.
A digit string as the column name (``image: "0"``) means a table without a
header row, columns by position; relative image paths are taken from the
table's folder.
"""

from __future__ import annotations

import csv
import io
import posixpath
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from datacat.errors import RecordError, ShardError
from datacat.formats import RawItem, record_caption
from datacat.registry import Format
from datacat.storage import read_bytes, read_many

if TYPE_CHECKING:
    from datacat.plan import Plan

__all__ = ["FORMAT", "ImageListReader", "read_table"]


def read_table(url: str, storage_options: dict[str, Any], columns: list[str]) -> list[dict[str, Any]]:
    """The rows of one table as dicts holding ``columns``."""
    data = read_bytes(url, storage_options)
    if url.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq  # only parquet lists need pyarrow
        except ImportError as exc:
            raise ShardError(f"{url} is parquet, which needs pyarrow: pip install pyarrow", url=url) from exc
        table = pq.read_table(io.BytesIO(data))
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise ShardError(f"table {url} has no column(s) {missing} (it has {table.column_names})", url=url)
        return table.select(columns).to_pylist()  # type: ignore[no-any-return]
    delimiter = "\t" if url.endswith(".tsv") else ","
    text = data.decode("utf-8")
    headerless = all(c.isdigit() for c in columns)
    rows = list(csv.reader(io.StringIO(text), delimiter=delimiter))
    if headerless:
        return [{c: row[int(c)] if int(c) < len(row) else None for c in columns} for row in rows if row]
    if not rows:
        return []
    header = rows[0]
    missing = [c for c in columns if c not in header]
    if missing:
        raise ShardError(f"table {url} has no column(s) {missing} (its header is {header})", url=url)
    return [dict(zip(header, row, strict=False)) for row in rows[1:] if row]


class ImageListReader:
    """Images named by table rows, by global index over all tables in plan order."""

    random_access: Literal[True] = True

    def __init__(self, plan: Plan) -> None:
        self.name = plan.name
        self.storage_options = dict(plan.storage_options)
        self.record = plan.record
        if not plan.record.image:
            raise ShardError(f"{plan.name}: an image_list entry needs record.image, the column of image paths")
        columns = [c for c in (plan.record.image, plan.record.caption, plan.record.label) if c]
        self.rows: list[tuple[str, int, dict[str, Any]]] = []
        counts = []
        for shard in plan.shards:
            table = read_table(shard.url, self.storage_options, columns)
            self.rows += [(shard.url, i, row) for i, row in enumerate(table)]
            counts.append(len(table))
        self.counts = tuple(counts)

    def __repr__(self) -> str:
        return f"ImageListReader({self.name!r}, rows={len(self.rows)})"

    def __len__(self) -> int:
        return len(self.rows)

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]:
        """Rows ``indices`` of the tables with the images they name, fetched concurrently."""
        rows = [self.rows[i] for i in indices]
        paths = [self._path(table, row) for table, _, row in rows]
        fetched = read_many([p for p in paths if p], self.storage_options)
        images = iter(fetched)
        out: list[RawItem | Exception] = []
        for index, (table, row_number, row), path in zip(indices, rows, paths, strict=True):
            key = f"{posixpath.basename(table)}:{row_number}"
            data = (
                next(images)
                if path
                else RecordError(f"{table} row {row_number}: no image path in column {self.record.image!r}")
            )
            if isinstance(data, FileNotFoundError):
                data = RecordError(f"image {path} listed in {table} (row {row_number}) does not exist")
            out.append(data if isinstance(data, Exception) else RawItem(key, table, index, (row, data)))
        return out

    def _path(self, table: str, row: dict[str, Any]) -> str | None:
        path = row.get(str(self.record.image))
        if not path:
            return None
        path = str(path)
        if "://" not in path and not path.startswith("/"):
            path = posixpath.join(posixpath.dirname(table), path)
        return path

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one row: the image it names, its caption and label."""
        (row, image), record = item.payload, self.record
        out: dict[str, Any] = {"__key__": item.key, "__shard__": item.shard, "__uid__": item.uid, "image": image}
        out["caption"] = record_caption(row, (record.caption,)) if record.caption else None
        if record.label and row.get(record.label) is not None:
            out["label"] = int(row[record.label])
        return out


def _names_a_table(shard: str) -> bool:
    return shard.lower().endswith((".csv", ".tsv", ".parquet"))


def _contract(plan: Plan) -> list[str]:
    record = plan.record
    return [
        f"A CSV, TSV or parquet table with image paths in column {record.image!r}"
        + (f" and captions in {record.caption!r}." if record.caption else ".")
    ]


FORMAT = Format(
    ImageListReader,
    "random",
    ("table",),
    _contract,
    names_a_shard=_names_a_table,
    shards_are="its shards are tables (.csv, .tsv or .parquet) with a column of image paths, e.g. shards: images.csv",
    counted="at_open",
)
