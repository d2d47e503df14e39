"""ArrayRecord shards read by index: local ones through array_record's data source, remote ones by exact ranges.

Imported from array_record itself rather than from grain, whose import pulls
in jax; the torch path must not pay for that. Record counts come from the
catalog's ``per_shard`` when declared, so opening a dataset does not open
every local shard; each shard's real count is checked against the declared
one the first time this process reads from it.

A remote shard's chunk index (its footer, read once and cached beside the
manifest) makes each record one exact byte range fetched through fsspec,
a batch's ranges at once (:mod:`datacat.formats.riegeli`): array_record's
own client asks for open-ended ranges and opens a connection per record.
A shard whose chunks are not decoded in Python (brotli, snappy, transposed)
is read by the C++ client, as local shards are.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import itertools
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from datacat.cache import cache_dir
from datacat.errors import RecordError, ShardError
from datacat.formats import RawItem, check_declared, record_caption, riegeli
from datacat.formats.ar_pixels import pre_resized_fill
from datacat.formats.ar_shards import (
    check_reachable,
    count_elsewhere,
    index_dir,
    index_shard,
    open_shard,
    remember_counts,
    used_here,
    verify_counter,
)
from datacat.formats.metadata import decoded_fields
from datacat.formats.packed import packed_label, unpack_pre_resized, unpack_views
from datacat.formats.tf_example import example_record, tfds_lengths
from datacat.registry import Format
from datacat.storage import is_remote, read_ranges, with_retries
from datacat.storage.manifests import Manifest, ShardFacts, load_manifest, save_manifest

if TYPE_CHECKING:
    from datacat.plan import Plan

log = logging.getLogger(__name__)

__all__ = ["FORMAT", "ArrayRecordReader"]


@dataclasses.dataclass(frozen=True)
class _FileInstruction:
    # The shape array_record's data source accepts instead of a path, to skip opening the file.
    filename: str
    skip: int
    take: int
    examples_in_shard: int


class ArrayRecordReader:
    """Records of ArrayRecord shards by global index, shards in plan order, a batch's records read at once."""

    random_access: Literal[True] = True

    def __init__(self, plan: Plan) -> None:
        self.name = plan.name
        self.urls = tuple(s.url for s in plan.shards)
        self.names = tuple(s.name for s in plan.shards)
        self.storage_options = dict(plan.storage_options)
        self.remote = bool(self.urls) and is_remote(self.urls[0])
        self.record = plan.record
        self.declared = tuple(s.samples for s in plan.shards)
        self.index_files: tuple[str, ...] = ()
        self._chunks: dict[int, riegeli.ChunkIndex] = {}
        counts = list(self.declared)
        if self.record.layout == "tf_example" and None in counts:  # a TFDS folder says its shard lengths
            lengths = tfds_lengths(plan.root, plan.storage_options)
            counts = [n if n is not None else lengths.get(name) for n, name in zip(counts, self.names, strict=True)]
            self.declared = tuple(counts)
        facts = self._chunk_indexes(plan) if self.remote else None
        if facts is not None:  # every shard has its chunk index: records are exact ranges, counts are known
            check_declared(self.urls, self.declared, [f.records for f in facts], kind="ArrayRecord shard ")
            self.index_files = tuple(str(f.index) for f in facts)
            counts = [f.records for f in facts]
        elif self.remote:
            check_reachable(self.urls[0], self.storage_options)
        uncounted = [i for i, n in enumerate(counts) if n is None]
        if uncounted:  # no per_shard and no manifest: read each footer once, all at once, elsewhere
            for i, n in zip(uncounted, count_elsewhere([self.urls[i] for i in uncounted]), strict=True):
                counts[i] = n
            remember_counts(plan, counts)
        self.counts = tuple(int(n or 0) for n in counts)
        self.offsets = tuple(itertools.accumulate(self.counts, initial=0))
        self._source: Any = None
        self._checked: dict[int, Any] = {}  # the C++ reader of each shard opened and checked in this process

    def __repr__(self) -> str:
        return f"ArrayRecordReader({self.name!r}, shards={len(self.urls)}, records={len(self)})"

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_checked"] = {}
        state["_source"] = None  # opens its readers again in each process
        state["_chunks"] = {}  # workers map the index files themselves
        return state

    @property
    def source(self) -> Any:
        """array_record's data source over the shards (its C++ reader also reads gs:// itself), made on first read.

        Made here, not when the entry is opened: loading the C++ library in a
        process makes forking it unsafe (:func:`~datacat.formats.ar_shards.used_here`).
        A local record is read in the calling thread (``max_parallelism:0``):
        by default each read of one record is handed to the reader's thread
        pool and waited for, ~4 % of a torch worker's images a second here.
        """
        if self._source is None:
            from array_record.python import array_record_data_source

            self._source = array_record_data_source.ArrayRecordDataSource(
                [_FileInstruction(url, 0, n, n) for url, n in zip(self.urls, self.counts, strict=True)],
                reader_options=None if self.remote else {"max_parallelism": "0"},
            )
        return self._source

    def _chunk_indexes(self, plan: Plan) -> list[ShardFacts] | None:
        # Each remote shard's chunk index, from the cache or read now (all shards at once); None if a shard's
        # chunks are not decoded in Python.
        manifest = load_manifest(plan.manifest) or Manifest(plan.manifest, plan.name, plan.root, {})
        names = self.names
        todo = [
            i
            for i, name in enumerate(names)
            if (facts := manifest.shards.get(name)) is None
            or facts.url != self.urls[i]
            or facts.index is None
            or not (index_dir() / facts.index).is_file()
        ]
        if todo:
            log.info(
                "%s: reading the chunk index of %d ArrayRecord shard(s) (once; cached in %s)",
                self.name,
                len(todo),
                cache_dir(),
            )

            def one(i: int) -> ShardFacts | None:
                known = manifest.shards.get(names[i])
                size = known.bytes if known is not None and known.url == self.urls[i] else None
                return index_shard(self.urls[i], names[i], self.storage_options, size=size)

            with concurrent.futures.ThreadPoolExecutor(min(16, len(todo))) as pool:
                found = list(pool.map(one, todo))
            if any(f is None for f in found):
                return None
            for i, facts in zip(todo, found, strict=True):
                manifest.shards[names[i]] = facts  # type: ignore[assignment]
            try:
                save_manifest(manifest)
            except OSError as exc:  # a read-only cache costs the footers again next time, nothing else
                log.warning("cannot write the manifest of %s to %s: %s", plan.name, cache_dir(), exc)
        return [manifest.shards[n] for n in names]

    def _chunk_index(self, shard: int) -> riegeli.ChunkIndex:
        index = self._chunks.get(shard)
        if index is None:
            import numpy as np

            array = np.load(index_dir() / self.index_files[shard])
            index = self._chunks[shard] = riegeli.ChunkIndex.from_array(array)
        return index

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, position in shard) of global record ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} is outside 0..{len(self) - 1} of {self.name}")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return shard, index - self.offsets[shard]

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]:
        """The raw records at global ``indices``: remote ones read concurrently, local ones one after another.

        (array_record's ``__getitems__`` starts a thread pool per call: worth it
        for 30-100 ms requests, twice the cost of plain reads from local disk.)

        A record that cannot be read is returned as its error: a damaged
        chunk is a ``RecordError`` for the bad-sample policy, a shard that
        cannot be opened a ``ShardError``.
        """
        where = [self.locate(i) for i in indices]
        if self.index_files:
            return self._items(indices, where, self._read_ranges(where))
        try:
            for shard in {s for s, _ in where} - self._checked.keys():
                self._open_shard(shard)
            if not self.remote:
                payloads: list[bytes | Exception] = [self._read_local(shard, position) for shard, position in where]
                return self._items(indices, where, payloads)
            payloads = list(
                with_retries(
                    lambda: self.source.__getitems__(list(indices)),
                    self.urls[where[0][0]] if where else "",
                    any_error=self.remote,
                )
            )
        except (ShardError, FileNotFoundError):
            raise
        except (RuntimeError, ValueError, OSError):  # a record of the batch is damaged: read one by one to see which
            payloads = [self._read_one(i, shard, position) for i, (shard, position) in zip(indices, where, strict=True)]
        return self._items(indices, where, payloads)

    def _items(
        self,
        indices: Sequence[int],
        where: Sequence[tuple[int, int]],
        payloads: Sequence[bytes | memoryview | Exception],
    ) -> list[RawItem | Exception]:
        return [
            data
            if isinstance(data, Exception)
            else RawItem(f"{os.path.basename(self.urls[shard])}:{position}", self.urls[shard], index, data)
            for index, (shard, position), data in zip(indices, where, payloads, strict=True)
        ]

    def _read_ranges(self, where: Sequence[tuple[int, int]]) -> list[bytes | memoryview | Exception]:
        # Each chunk the records lie in, fetched once, all at once; a record of a chunk that does not
        # decode is a RecordError for the bad-sample policy.
        wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for slot, (shard, position) in enumerate(where):
            c, k = self._chunk_index(shard).locate(position)
            wanted.setdefault((shard, c), []).append((slot, k))
        requests = [
            (self.urls[shard], int(self._chunk_index(shard).starts[c]), int(self._chunk_index(shard).ends[c]))
            for shard, c in wanted
        ]
        out: list[bytes | memoryview | Exception] = [b""] * len(where)
        for shard_chunk, (url, start, _), data in zip(
            wanted, requests, read_ranges(requests, self.storage_options), strict=True
        ):
            records: list[bytes | memoryview] | Exception
            if isinstance(data, Exception):
                records = data
            else:
                try:
                    records = riegeli.decode_chunk(data, start)
                except ValueError as exc:
                    records = exc
            for slot, k in wanted[shard_chunk]:
                if isinstance(records, list) and k < len(records):
                    out[slot] = records[k]
                    continue
                position = where[slot][1]
                out[slot] = (
                    records
                    if isinstance(records, ShardError | FileNotFoundError)
                    else RecordError(
                        f"record {position} of ArrayRecord shard {url} cannot be read: "
                        f"{records if isinstance(records, Exception) else 'its chunk holds fewer records'}",
                        url=url,
                        key=f"{os.path.basename(url)}:{position}",
                    )
                )
        return out

    def _read_local(self, shard: int, position: int) -> bytes | Exception:
        # A local record straight from the shard's reader checked when it was opened: a disk read is
        # not retried, and the data source's lookup of the reader would run again for every record.
        try:
            data: bytes = self._checked[shard].read([position])[0]
        except (RuntimeError, ValueError, OSError) as exc:  # the C++ reader's errors carry only a status text
            return self._unreadable(shard, position, exc)
        return data

    def _unreadable(self, shard: int, position: int, exc: Exception) -> RecordError:
        url = self.urls[shard]
        return RecordError(
            f"record {position} of ArrayRecord shard {url} cannot be read: {exc}",
            url=url,
            key=f"{os.path.basename(url)}:{position}",
        )

    def _read_one(self, index: int, shard: int, position: int) -> bytes | Exception:
        try:
            return with_retries(lambda: self.source[index], self.urls[shard], any_error=self.remote)  # type: ignore[no-any-return]
        except (ShardError, FileNotFoundError) as exc:
            return exc
        except (RuntimeError, ValueError, OSError) as exc:  # the C++ reader's errors carry only a status text
            return self._unreadable(shard, position, exc)

    def _open_shard(self, shard: int) -> None:
        # The data source opens the shard's reader on its first read; open it here to say which shard
        # fails, and compare its real count with the declared one (one footer read, by the reader kept).
        url = self.urls[shard]
        idx = self.source._reader_idx_and_position(self.offsets[shard])[0]

        def open_reader() -> Any:
            self.source._ensure_reader_exists(idx)
            reader = self.source._readers[idx]
            if not reader.ok():  # a footer read cut short looks like a damaged file: try again before saying so
                self.source._readers[idx] = None
                raise RuntimeError(f"{url}: the reader did not open")
            return reader

        try:
            reader = with_retries(open_reader, url, any_error=self.remote)
        except (ShardError, FileNotFoundError):
            raise
        except (RuntimeError, ValueError, OSError):  # the data source's own open failed: _open says why, naming it
            open_shard(url).close()
            raise
        check_declared([url], [self.counts[shard]], [int(reader.num_records())], kind="ArrayRecord shard ")
        self._checked[shard] = reader

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one ArrayRecord entry, by the entry's layout (packed, pre_resized, single)."""
        record = self.record
        out: dict[str, Any] = {"__key__": item.key, "__shard__": item.shard, "__uid__": item.uid}
        if record.layout == "tf_example":
            return example_record(bytes(item.payload), record, out)  # its parser wants bytes, not a view
        if record.layout == "single":
            out.update(image=item.payload, caption=None)
            return out
        entries = unpack_views(item.payload)  # views: the image is not copied out of its record
        if record.layout == "pre_resized":
            out["image"] = unpack_pre_resized(entries)
            caption_keys: tuple[str, ...] = (record.caption, "caption") if record.caption else ()
        else:
            out["image"] = entries.get(record.image) if record.image else None
            caption_keys = (record.caption,) if record.caption else ()
        out["caption"] = record_caption(entries, caption_keys) if caption_keys else None  # caption: null, image only
        label_key = record.label or ("label" if record.layout == "pre_resized" else None)
        if label_key and label_key in entries:
            out["label"] = packed_label(bytes(entries[label_key]))
        if record.key and record.key in entries:
            out["__key__"] = str(entries[record.key], "utf-8", "replace")
        if record.fields:
            fields = decoded_fields(record.fields, entries)
            if len(fields) < len(record.fields):
                absent = [name for name in record.fields if name not in fields]
                raise ValueError(
                    f"record has no {', '.join(map(repr, absent))} (record.fields; it has {sorted(entries)})"
                )
            out.update(fields)
        out["entries"] = entries
        return out


def _contract(plan: Plan) -> list[str]:
    record = plan.record
    lines = ["Each shard is an ArrayRecord file; a record is one sample."]
    if record.layout == "packed":
        lines.append(
            "A record is a packed dict: for each entry a little-endian uint32 key length, the utf-8 key, "
            f"a uint32 value length and the value; key {record.image!r} holds the encoded image"
            + (f", {record.caption!r} the utf-8 caption" if record.caption else "")
            + (f", {record.key!r} the sample id" if record.key else "")
            + "."
        )
    elif record.layout == "pre_resized":
        lines.append(
            "A record is a packed dict with 'image' (raw uint8 HxWx3), 'shape' (two little-endian int32: H, W), "
            "'caption' (utf-8) and optionally 'label'."
        )
    elif record.layout == "tf_example":
        image = record.image if record.image != "jpg" else "image"
        lines.append(
            "A record is a serialized tf.train.Example, as `tfds build --file_format=array_record` writes it: "
            f"feature {image!r} the encoded image, {(record.label or 'label')!r} the label, "
            f"{(record.key or 'file_name')!r} the key"
            + (f", {record.caption!r} the caption" if record.caption else "")
            + "."
        )
        lines.append(
            "Without totals.per_shard, the shard lengths come from dataset_info.json beside the shards; "
            "class names from loading.captions.class_names, else label.labels.txt beside the shards."
        )
    else:
        lines.append("A record is one encoded image, with no caption.")
    return lines


FORMAT = Format(
    ArrayRecordReader,
    "random",
    ("packed", "pre_resized", "single", "tf_example"),
    _contract,
    used_here=used_here,
    shard_facts=verify_counter,
    fill=pre_resized_fill,
    fields=True,
    doc=__doc__ or "",
    hint="array_record shards need array-record: pip install array-record",
)
