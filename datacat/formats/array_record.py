"""ArrayRecord shards read by index through array_record's random-access data source.

Imported from array_record itself rather than from grain, whose import pulls
in jax; the torch path must not pay for that. Record counts come from the
catalog's ``per_shard`` when declared, so opening a dataset does not open
every shard; each shard's real count is checked against the declared one
the first time this process reads from it.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
from typing import Any

# The C++ reader (it also reads gs:// itself); only array_record entries need it.
from array_record.python import array_record_data_source, array_record_module

from datacat.errors import ShardError
from datacat.formats import RawItem, record_caption
from datacat.formats.packed import unpack_pre_resized, unpack_record
from datacat.resolve import Plan

__all__ = ["ArrayRecordReader", "count_records", "opened_here"]


@dataclasses.dataclass(frozen=True)
class _FileInstruction:
    # The shape array_record's data source accepts instead of a path, to skip opening the file.
    filename: str
    skip: int
    take: int
    examples_in_shard: int


def opened_here() -> bool:
    """Whether this process has opened an ArrayRecord reader: forking it after that crashes the child.

    array_record's C++ client keeps process-wide state that a forked child
    inherits half-alive (seen here: the child segfaults on its first read).
    """
    return os.getpid() == _OPENED_IN


_OPENED_IN = 0


def _note_opened() -> None:
    global _OPENED_IN
    _OPENED_IN = os.getpid()


def _open(url: str) -> Any:
    _note_opened()
    # The C++ reader does not raise on a failed open: ok() turns False and close() raises the status.
    reader = array_record_module.ArrayRecordReader(url)
    if reader.ok():
        return reader
    try:
        reader.close()
        status = "unknown error"
    except RuntimeError as exc:
        status = str(exc)
    if "No such file" in status or "NOT_FOUND" in status:
        raise FileNotFoundError(2, f"shard not found: {url}; check the entry's root or its missing list", url)
    raise ShardError(
        f"ArrayRecord shard {url} cannot be read ({status or 'no valid footer'}): it is truncated or not an "
        "ArrayRecord file. Re-copy it, or add it to the entry's missing list."
    )


def count_records(url: str) -> int:
    """The number of records in one shard."""
    reader = _open(url)
    try:
        return int(reader.num_records())
    finally:
        reader.close()


def check_reachable(url: str, storage_options: dict[str, Any]) -> None:
    """Raises unless fsspec can see remote ``url``: array_record's own GCS client would retry for minutes."""
    import fsspec  # remote shards only

    try:
        fs, path = fsspec.core.url_to_fs(url, **storage_options)
        fs.info(path)
    except FileNotFoundError:
        raise FileNotFoundError(2, f"shard not found: {url}; check the entry's root or its missing list", url) from None
    except Exception as exc:  # gcsfs/aiohttp raise their own types for network and auth failures
        raise ShardError(
            f"cannot reach {url}: {exc}. Check the network and credentials, or set DATACAT_ROOT (or root=) "
            "to a local copy"
        ) from exc


class ArrayRecordReader:
    """Records of ArrayRecord shards by global index, shards in plan order."""

    def __init__(self, plan: Plan) -> None:
        self.name = plan.name
        self.urls = tuple(s.url for s in plan.shards)
        if self.urls and "://" in self.urls[0] and not self.urls[0].startswith("file://"):
            check_reachable(self.urls[0], dict(plan.storage_options))
        self.record = plan.record
        self.declared = tuple(s.samples for s in plan.shards)
        counts = [n if n is not None else count_records(url) for url, n in zip(self.urls, self.declared, strict=True)]
        self.counts = tuple(counts)
        self.offsets = tuple(itertools.accumulate(counts, initial=0))
        self.source = array_record_data_source.ArrayRecordDataSource(
            [_FileInstruction(url, 0, n, n) for url, n in zip(self.urls, counts, strict=True)]
        )
        self._checked: set[int] = set()

    def __repr__(self) -> str:
        return f"ArrayRecordReader({self.name!r}, shards={len(self.urls)}, records={len(self)})"

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_checked"] = set()
        return state

    def locate(self, index: int) -> tuple[int, int]:
        """(shard number, position in shard) of global record ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} is outside 0..{len(self) - 1} of {self.name}")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return shard, index - self.offsets[shard]

    def item(self, index: int) -> RawItem:
        """The raw bytes of global record ``index``."""
        shard, position = self.locate(index)
        if shard not in self._checked:
            _note_opened()  # the data source opens its reader on this first read
            self._check_shard(shard)
        try:
            data = self.source[index]
        except Exception as exc:  # the C++ reader's errors carry only a status text
            raise ShardError(f"cannot read record {position} of ArrayRecord shard {self.urls[shard]}: {exc}") from exc
        return RawItem(f"{os.path.basename(self.urls[shard])}:{position}", self.urls[shard], index, data)

    def iter_shard(self, shard: int) -> Any:
        """The raw records of one shard in order (the stream view of a random-access source)."""
        for index in range(self.offsets[shard], self.offsets[shard + 1]):
            yield self.item(index)

    def _check_shard(self, shard: int) -> None:
        declared = self.declared[shard]
        if declared is not None:
            actual = count_records(self.urls[shard])
            if actual != declared:
                raise ShardError(
                    f"ArrayRecord shard {self.urls[shard]} has {actual} records, the catalog declares {declared}; "
                    "correct totals.per_shard or re-copy the shard"
                )
        self._checked.add(shard)

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one ArrayRecord entry, by the entry's layout (packed, pre_resized, single)."""
        record = self.record
        out: dict[str, Any] = {"__key__": item.key, "__shard__": item.shard, "__uid__": item.uid}
        if record.layout == "single":
            out.update(image=item.payload, caption=None)
            return out
        entries = unpack_record(item.payload)
        if record.layout == "pre_resized":
            out["image"] = unpack_pre_resized(entries)
            caption_key = record.caption or "caption"
        else:
            out["image"] = entries.get(record.image) if record.image else None
            caption_key = record.caption or "txt"
        out["caption"] = record_caption(entries, (caption_key,))
        label_key = record.label or ("label" if record.layout == "pre_resized" else None)
        if label_key and label_key in entries:
            out["label"] = _label(entries[label_key])
        if record.key and record.key in entries:
            out["__key__"] = entries[record.key].decode("utf-8", "replace")
        out["entries"] = entries
        return out


def _label(raw: bytes) -> int:
    # Written as ascii digits by most packers; a 4- or 8-byte little-endian int otherwise.
    text = raw.strip()
    if text and all(c in b"0123456789-" for c in text):
        return int(text)
    if len(raw) in (4, 8):
        return int.from_bytes(raw, "little", signed=True)
    raise ValueError(f"label {raw!r} is neither an integer text nor a little-endian int")
