"""Record selection: the canonical positions of the records whose metadata meet an entry's ``select`` bounds.

img2dataset writes a shard's successful rows to its parquet in the order of
the samples in its tar, so the k-th successful row is the tar's k-th sample.
:func:`build_selection` reads the bounded columns of every shard's table
(16 at a time), checks each table's successful rows against the tar's
sample count, and keeps the positions of the rows that meet every bound.
The result is saved in the cache under a hash of the shards and the bounds
(an ``.npy`` of int64 positions and a ``.json`` with its count, which
``describe`` reads), so it is built once; a worker maps the file instead of
receiving a copy. :func:`stored_sizes` reads the image sizes that
aspect-ratio buckets need the same way.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from datacat.cache import cache_dir
from datacat.errors import ShardError
from datacat.formats.metadata import read_table, table_url
from datacat.schema import Condition
from datacat.storage import is_remote

if TYPE_CHECKING:
    import numpy as np

    from datacat.plan import Plan

__all__ = ["Selection", "build_selection", "selected_count", "stored_sizes"]

T = TypeVar("T")


def _cached(plan: Plan, decides: dict[str, Any], stem: str = "") -> Path:
    """The cache file (no suffix) of what the plan's shards and ``decides`` alone decide (not the seed, nor the batch)."""
    key = {"shards": [(shard.name, shard.url) for shard in plan.shards], **decides}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / "selections" / f"{stem}{digest}"


def _paths(plan: Plan) -> tuple[Path, Path]:
    """The cache's files of a plan's selection: its positions and its count."""
    bounds = {column: condition.bounds() for column, condition in sorted(plan.select.items())}
    stem = _cached(plan, {"select": bounds})
    return stem.with_suffix(".npy"), stem.with_suffix(".json")


def _save(path: Path, write: Callable[[Path], object]) -> None:
    """``write`` to a temporary name beside ``path``, then renamed to it: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    write(tmp)
    os.replace(tmp, path)


def selected_count(plan: Plan) -> int | None:
    """The number of records ``plan`` selects, if its selection is in the cache (no storage read)."""
    _, count = _paths(plan)
    try:
        return int(json.loads(count.read_text())["selected"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Selection:
    """The selected canonical positions of one Plan, ascending; picklable as its file's path."""

    def __init__(self, path: Path, count: int) -> None:
        self.path = path
        self.count = count
        self._positions: np.ndarray | None = None

    def __repr__(self) -> str:
        return f"Selection({self.count} records)"

    def __len__(self) -> int:
        return self.count

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_positions": None}

    @property
    def positions(self) -> np.ndarray:
        """The positions, mapped from the cache's file (a plain array over the mapping: fast to index)."""
        if self._positions is None:
            import numpy as np

            self._positions = np.load(self.path, mmap_mode="r").view(np.ndarray)
        return self._positions

    def take(self, indices: Sequence[int] | np.ndarray) -> list[int]:
        """The canonical positions of the ``indices``-th selected records."""
        import numpy as np

        out: list[int] = self.positions[np.asarray(indices, dtype=np.int64)].tolist()
        return out


def build_selection(plan: Plan, counts: Sequence[int]) -> Selection:
    """The selection of ``plan`` over shards of ``counts`` samples: from the cache, else read from the tables now."""
    array_path, count_path = _paths(plan)
    count = selected_count(plan)
    if count is not None and array_path.is_file():
        return Selection(array_path, count)
    import numpy as np

    masks = _per_shard(plan, counts, lambda url, samples: _shard_mask(plan, url, samples))
    offsets = np.cumsum([0, *counts[:-1]], dtype=np.int64) if counts else np.zeros(0, np.int64)
    positions = np.concatenate([np.flatnonzero(m) + o for m, o in zip(masks, offsets, strict=True)] or [np.zeros(0)])
    positions = positions.astype(np.int64)
    _save(array_path, lambda tmp: np.save(tmp, positions))
    facts = json.dumps({"name": plan.name, "selected": len(positions), "of": int(sum(counts))})
    _save(count_path, lambda tmp: tmp.write_text(facts))
    return Selection(array_path, len(positions))


def _success_rows(plan: Plan, url: str, samples: int, columns: Sequence[str], what: str) -> Any:
    """The ``columns`` of one shard table's successful rows, in order, checked against its tar's ``samples``."""
    try:
        names, table = read_table(url, columns, plan.storage_options)
    except ValueError as exc:
        raise ShardError(f"{plan.name}: {exc}", url=url) from None
    absent = [c for c in columns if c not in names]
    if absent:
        raise ShardError(
            f"{plan.name}: {what} {', '.join(map(repr, absent))}, which {url} has no column of "
            f"(its columns: {', '.join(names)})",
            url=url,
        )
    if table.num_rows != samples:
        raise ShardError(
            f"{plan.name}: {url} has {table.num_rows} successful rows but its tar holds {samples} samples; "
            f"{what.split()[0]} needs the table img2dataset wrote with the tar",
            url=url,
        )
    return table


def _per_shard(plan: Plan, counts: Sequence[int], read: Callable[[str, int], T]) -> list[T]:
    """``read(table_url, samples)`` of every shard, in order: 16 at a time from a bucket, one by one from a disk."""
    urls = [table_url(shard.url) for shard in plan.shards]
    threads = min(16, len(urls)) if urls and is_remote(urls[0]) else 1
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        return list(pool.map(read, urls, counts))


def _shard_mask(plan: Plan, url: str, samples: int) -> np.ndarray:
    """Which of one shard's samples meet every bound, from its table's successful rows in order."""
    import numpy as np
    import pyarrow as pa

    table = _success_rows(plan, url, samples, list(plan.select), "select bounds")
    keep = np.ones(samples, dtype=bool)
    for column, condition in plan.select.items():
        try:
            keep &= _meets(table[column], condition)
        except (pa.ArrowException, TypeError, ValueError) as exc:  # a bound of another type than the column's
            raise ShardError(
                f"{plan.name}: select.{column} cannot bound column {column!r} of {url} "
                f"({table.schema.field(column).type}): {exc}; fix select",
                url=url,
            ) from None
    return keep


def stored_sizes(plan: Plan, counts: Sequence[int]) -> np.ndarray:
    """(height, width) of every record's stored image, int32 [records, 2] in canonical order, from the tables.

    img2dataset's ``width`` and ``height`` columns; cached like a selection.
    """
    import numpy as np

    path = _cached(plan, {"sizes": ["height", "width"]}, "sizes-").with_suffix(".npy")
    if path.is_file():
        cached: np.ndarray = np.load(path)
        return cached

    def shard_sizes(url: str, samples: int) -> np.ndarray:
        table = _success_rows(plan, url, samples, ["height", "width"], "buckets need the image sizes")
        sizes = np.stack([table[c].to_numpy(zero_copy_only=False) for c in ("height", "width")], axis=1)
        if samples and (np.isnan(sizes.astype(np.float64)).any() or (sizes <= 0).any()):
            raise ShardError(f"{plan.name}: {url} has a successful row without a positive width and height", url=url)
        return sizes.astype(np.int32).reshape(samples, 2)

    parts = _per_shard(plan, counts, shard_sizes)
    sizes = np.concatenate(parts) if parts else np.zeros((0, 2), np.int32)
    _save(path, lambda tmp: np.save(tmp, sizes))
    return sizes


_COMPARE = {"ge": "greater_equal", "gt": "greater", "le": "less_equal", "lt": "less", "eq": "equal", "ne": "not_equal"}


def _meets(column: Any, condition: Condition) -> np.ndarray:
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    keep = pa.array(np.ones(len(column), dtype=bool))
    for name, bound in condition.bounds().items():
        if name == "in_":
            met = pc.is_in(column, value_set=pa.array(list(bound)))
        else:
            met = getattr(pc, _COMPARE[name])(column, bound)
        keep = pc.and_kleene(keep, pc.fill_null(met, False))
    out: np.ndarray = keep.to_numpy(zero_copy_only=False)
    return out
