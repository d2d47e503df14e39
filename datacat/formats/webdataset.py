"""Tar shards read as webdataset does: url -> tar members -> samples grouped by key.

Each stage is a small generator named for what it yields, testable alone.
Compression is detected from the bytes (shards named ``.tar`` are sometimes
gzipped), a sample's key is the member path up to the first dot of its file
name, and a key that comes back after another key, or a member given twice,
is a format problem rather than two samples silently merged.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import itertools
import logging
import os
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from datacat.cache import cache_dir
from datacat.errors import RecordError, ShardError
from datacat.formats import RawItem, check_declared, record_caption
from datacat.formats.metadata import ShardTables, owned, table_url
from datacat.registry import Format
from datacat.schema import Record
from datacat.storage import is_remote, open_url, read_ranges
from datacat.storage.manifests import Manifest, ShardFacts, load_manifest, save_index, save_manifest

if TYPE_CHECKING:
    import numpy as np

    from datacat.plan import Plan
from datacat.formats.tar import (
    decode_member,
    group_by_key,
    member_spans,
    sample_of_span,
    tar_members,
)

__all__ = ["FORMAT", "TarStream", "WebDatasetReader", "open_tars", "parse_sample"]

log = logging.getLogger(__name__)


def _index_dir() -> Path:
    return cache_dir() / "tar-index"


def parse_sample(record: Record, item: RawItem) -> dict[str, Any]:
    """The record of one tar sample: the members the entry's record layout names, decoded.

    Members it does not name (img2dataset's ``.json`` metadata, say) are not
    decoded: they cost time, and a damaged one would lose a good sample.
    """
    named = {record.image, record.caption, record.label, record.key, record.embedding, *record.fields}
    members = dict(decode_member(ext, data) for ext, data in item.payload.items() if ext.removesuffix(".gz") in named)
    out: dict[str, Any] = {"__key__": item.key, "__shard__": item.shard, "__uid__": item.uid}
    out["image"] = members.get(record.image) if record.image else None
    out["caption"] = record_caption(members, (record.caption,)) if record.caption else None
    if record.label:
        out["label"] = members.get(record.label)
    if record.key and record.key in members:
        out["__key__"] = str(members[record.key])
    if record.embedding:
        out["embedding"] = members.get(record.embedding)
    out.update({name: owned(members[name]) for name in record.fields if name in members})
    return out


def _joined(record: dict[str, Any], fields: Sequence[str], tables: ShardTables | None) -> dict[str, Any]:
    """``record`` with the fields its members lack from its shard's metadata table; a field found nowhere is an error."""
    wanted = [name for name in fields if name not in record]
    if tables is not None:
        tables.join(record, wanted)
    elif wanted:
        raise ValueError(f"sample has no member .{', .'.join(wanted)} (record.fields) and the entry joins no metadata")
    return record


def _tables(plan: Plan) -> ShardTables | None:
    if plan.record.metadata is None:
        return None
    return ShardTables(plan.name, plan.record.fields, plan.storage_options, ordered=bool(plan.select))


class TarStream:
    """Samples of tar shards, shard by shard in the order of each tar: a :class:`~datacat.formats.StreamReader`.

    The reader of an entry with a gzip-compressed shard (which cannot be read
    by range), and of the image tars an ``embeddings`` entry pairs with its
    files. ``index_shard`` reads one shard's member spans for the index.
    """

    random_access: Literal[False] = False

    def __init__(self, plan: Plan, counts: Sequence[int] = ()) -> None:
        self.name = plan.name
        self.urls = tuple(s.url for s in plan.shards)
        self.names = tuple(s.name for s in plan.shards)
        self.record = plan.record
        self.storage_options = dict(plan.storage_options)
        self.block_size = int(plan.loading.read_ahead)
        self.counts = tuple(counts)
        self.tables = _tables(plan)

    def __repr__(self) -> str:
        return f"TarStream({self.name!r}, shards={len(self.urls)})"

    def iter_shard(self, shard: int) -> Generator[RawItem, None, None]:
        """The raw samples of shard ``shard``, in the order of the tar."""
        url = self.urls[shard]
        with open_url(url, self.storage_options, block_size=self.block_size) as stream:
            for position, (key, fields) in enumerate(group_by_key(tar_members(stream, url), url)):
                yield RawItem(key, url, (shard << 32) | position, fields)

    def index_shard(self, shard: int) -> ShardFacts:
        """Shard ``shard``'s facts: its samples and size, and its member spans saved in the cache (plain tars)."""
        url = self.urls[shard]
        with open_url(url, self.storage_options, block_size=self.block_size) as stream:
            size = int(stream.size) if hasattr(stream, "size") else os.fstat(stream.fileno()).st_size
            spans, compressed = member_spans(stream, url, seekable=not is_remote(url))
        if compressed:
            records = sum(1 for _ in self.iter_shard(shard))
            return ShardFacts(self.names[shard], records, url=url, bytes=size, compressed=True)
        index_file = save_index("tar-index", spans, url)
        return ShardFacts(self.names[shard], len(spans), url=url, bytes=size, index=index_file)

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one sample (:func:`parse_sample`), its metadata row joined."""
        return _joined(parse_sample(self.record, item), self.record.fields, self.tables)


class WebDatasetReader:
    """Samples of plain tar shards by global index, through each shard's member spans: a random-access reader.

    Made by :func:`open_tars` once every shard is indexed (from the cache's
    manifest, or read now), so that a sample is one byte range: tars are then
    random access like ArrayRecord, shuffled record by record.
    """

    random_access: Literal[True] = True

    def __init__(self, plan: Plan, facts: Sequence[ShardFacts]) -> None:
        self.name = plan.name
        self.urls = tuple(s.url for s in plan.shards)
        self.record = plan.record
        self.storage_options = dict(plan.storage_options)
        self.counts = tuple(f.records for f in facts)
        self.offsets = tuple(itertools.accumulate(self.counts, initial=0))
        self.index_files = tuple(str(f.index) for f in facts)
        self.tables = _tables(plan)
        self._spans: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return f"WebDatasetReader({self.name!r}, shards={len(self.urls)}, samples={len(self)})"

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_spans": {}}  # workers map the index files themselves

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, position in shard) of global sample ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside 0..{len(self) - 1} of {self.name}")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return shard, index - self.offsets[shard]

    def _span(self, shard: int, position: int) -> tuple[int, int]:
        spans = self._spans.get(shard)
        if spans is None:
            import numpy as np

            # A plain array over the mapped file: a memmap's indexing runs Python code (~3 us a record).
            spans = np.load(_index_dir() / self.index_files[shard], mmap_mode="r").view(np.ndarray)
            self._spans[shard] = spans
        start, end = spans[position].tolist()
        return start, end

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]:
        """The raw samples at global ``indices``, their byte spans fetched concurrently."""
        where = [self.locate(i) for i in indices]
        requests = [(self.urls[shard], *self._span(shard, position)) for shard, position in where]
        out: list[RawItem | Exception] = []
        for (shard, position), (url, start, _), data in zip(
            where, requests, read_ranges(requests, self.storage_options), strict=True
        ):
            if isinstance(data, Exception):
                out.append(data)
                continue
            try:
                key, fields = sample_of_span(data, url, start)
            except RecordError as exc:
                out.append(exc)
                continue
            out.append(RawItem(key, url, (shard << 32) | position, fields))
        return out

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one sample (:func:`parse_sample`), its metadata row joined."""
        return _joined(parse_sample(self.record, item), self.record.fields, self.tables)


def open_tars(plan: Plan) -> WebDatasetReader | TarStream:
    """The reader of a webdataset entry: by index once every shard is indexed, else (a gzip shard) shard by shard.

    Indexes every shard not yet in the cache's manifest, in parallel, each
    read once in large blocks; checks each shard's samples against the
    entry's ``per_shard``.
    """
    stream = TarStream(plan)
    if not plan.shards:
        return stream
    manifest = load_manifest(plan.manifest) or Manifest(plan.manifest, plan.name, "", {})
    todo = [
        i
        for i, shard in enumerate(plan.shards)
        if (facts := manifest.shards.get(shard.name)) is None
        or facts.url != shard.url
        or (facts.index is None and not facts.compressed)
        or (facts.index is not None and not (_index_dir() / facts.index).is_file())
    ]
    if todo:
        log.info("%s: indexing %d tar shard(s) (once; cached in %s)", plan.name, len(todo), cache_dir())
        # Remote shards are indexed 16 at a time, to overlap their latency. A local one is headers and
        # seeks under the GIL: threads gain nothing there, and each kept ~1.5 MB per 10k samples.
        threads = min(16, len(todo)) if is_remote(plan.shards[0].url) else 1
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for i, facts in zip(todo, pool.map(stream.index_shard, todo), strict=True):
                manifest.shards[plan.shards[i].name] = facts
        ordered = {s.name: manifest.shards[s.name] for s in plan.shards}
        ordered.update({n: f for n, f in manifest.shards.items() if n not in ordered})
        manifest.shards = ordered
        try:
            save_manifest(manifest)
        except OSError as exc:  # a read-only cache costs the index again next time, nothing else
            log.warning("cannot write the tar index manifest to %s: %s", cache_dir(), exc)
    known = [manifest.shards[s.name] for s in plan.shards]
    check_declared(
        stream.urls,
        [s.samples for s in plan.shards],
        [f.records for f in known],
        kind="tar shard ",
        holds="holds {} samples",
    )
    reader: WebDatasetReader | TarStream
    if any(f.compressed for f in known):
        reader = TarStream(plan, counts=[f.records for f in known])
    else:
        reader = WebDatasetReader(plan, known)
    if plan.record.fields and any(known_facts.records for known_facts in known):
        _check_fields(plan, reader)
    return reader


def _check_fields(plan: Plan, reader: WebDatasetReader | TarStream) -> None:
    """Refuses, at open, a ``record.fields`` name that the first sample's members and its shard's table both lack."""
    shard = next(i for i, count in enumerate(reader.counts) if count)
    if isinstance(reader, WebDatasetReader):
        (first,) = reader.items([reader.offsets[shard]])
        if isinstance(first, Exception):
            raise first
    else:
        with contextlib.closing(reader.iter_shard(shard)) as items:  # closes the shard's stream once read from
            first = next(items)
    members = {ext.removesuffix(".gz") for ext in first.payload}
    absent = [name for name in plan.record.fields if name not in members]
    if not absent:
        return
    where = f"sample {first.key!r} of {first.shard} has no member .{', .'.join(absent)}"
    if reader.tables is None:
        raise ShardError(
            f"{plan.name}: {where}; fix record.fields, or join a table with record.metadata", url=first.shard
        )
    columns = reader.tables.columns_of(table_url(first.shard))
    missing = [name for name in absent if name not in columns]
    if missing:
        raise ShardError(
            f"{plan.name}: {where}, and {table_url(first.shard)} has no column {', '.join(map(repr, missing))} "
            f"(its columns: {', '.join(columns)}); fix record.fields",
            url=first.shard,
        )


def _contract(plan: Plan) -> list[str]:
    record = plan.record
    return [
        "Each shard is a tar file, plain or gzip-compressed (detected from its bytes).",
        "Members of one sample are adjacent and share a key: the path up to the first dot of the file name.",
        f"The image is the member with extension .{record.image}"
        + (f", the caption .{record.caption} (utf-8)" if record.caption else "")
        + (f", the label .{record.label} (an integer)" if record.label else "")
        + ".",
    ]


def _shard_facts(plan: Plan, sizes: Mapping[str, int]) -> Callable[[int], ShardFacts]:
    return TarStream(plan).index_shard


FORMAT = Format(
    open_tars,
    "indexed",
    ("members",),
    _contract,
    arrays=("embedding",),
    shard_facts=_shard_facts,
    fields=True,
    metadata=("parquet",),
    doc=__doc__ or "",
)
