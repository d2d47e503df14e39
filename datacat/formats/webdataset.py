"""Tar shards read as webdataset does: url -> tar members -> samples grouped by key.

Each stage is a small generator named for what it yields, testable alone.
Compression is detected from the bytes (shards named ``.tar`` are sometimes
gzipped), a sample's key is the member path up to the first dot of its file
name, and a key that comes back after another key, or a member given twice,
is a format problem rather than two samples silently merged.
"""

from __future__ import annotations

import gzip
import io
import json
import re
import tarfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

import numpy as np

from datacat.errors import RecordError, ShardError
from datacat.formats import RawItem, record_caption
from datacat.formats.storage import open_url
from datacat.resolve import Plan

__all__ = ["WebDatasetReader", "decode_member", "group_by_key", "split_key", "tar_members"]

_KEY = re.compile(r"^((?:.*/|)[^./][^/]*?)\.([^/]*)$")


def split_key(path: str) -> tuple[str, str] | None:
    """(key, extension) of a member path: the key runs to the first dot of the file name."""
    match = _KEY.match(path)
    if match is None:
        return None
    stem, ext = match.groups()
    # The key ends at the first dot of the base name, whatever the directories hold.
    folder, _, base = stem.rpartition("/")
    first, dot, rest = base.partition(".")
    key = f"{folder}/{first}" if folder else first
    return key, (f"{rest}.{ext}" if dot else ext).lower()


def tar_members(stream: IO[bytes], url: str) -> Iterator[tuple[str, bytes]]:
    """(path, bytes) of each regular file in a plain or compressed tar stream, in order."""
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                handle = tar.extractfile(info)
                if handle is None:
                    continue
                yield info.name, handle.read()
    except (tarfile.TarError, EOFError, OSError, gzip.BadGzipFile, ValueError) as exc:
        raise ShardError(f"shard {url} is not a readable tar (or is truncated): {exc}") from exc


def group_by_key(members: Iterable[tuple[str, bytes]], url: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) of each sample; members of one sample must be adjacent."""
    done: set[str] = set()
    key: str | None = None
    fields: dict[str, bytes] = {}
    for path, data in members:
        split = split_key(path)
        if split is None:
            continue  # a file without an extension belongs to no sample (webdataset skips it too)
        member_key, ext = split
        if member_key != key:
            if key is not None:
                yield key, fields
                done.add(key)
            if member_key in done:
                raise RecordError(
                    f"shard {url}: key {member_key!r} appears again after other keys; members of a sample must be adjacent"
                )
            key, fields = member_key, {}
        if ext in fields:
            raise RecordError(f"shard {url}: key {member_key!r} has member .{ext} twice")
        fields[ext] = data
    if key is not None:
        yield key, fields


def decode_member(ext: str, data: bytes) -> tuple[str, Any]:
    """(extension without .gz, value) of one member: text, json, class index, array, or the bytes."""
    if ext.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise ValueError(f"member .{ext} is not valid gzip: {exc}") from None
        ext = ext[:-3]
    last = ext.rsplit(".", 1)[-1]
    try:
        if last in ("txt", "text"):
            return ext, data.decode("utf-8")
        if last == "json":
            return ext, json.loads(data)
        if last in ("cls", "cls2", "index"):
            return ext, int(data.decode("ascii").strip())
        if last == "npy":
            return ext, np.load(io.BytesIO(data), allow_pickle=False)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"member .{ext} cannot be decoded: {exc}") from None
    return ext, data


class WebDatasetReader:
    """Samples of webdataset tar shards, one shard at a time."""

    def __init__(self, plan: Plan) -> None:
        self.name = plan.name
        self.urls = tuple(s.url for s in plan.shards)
        self.record = plan.record
        self.storage_options = dict(plan.storage_options)

    def __repr__(self) -> str:
        return f"WebDatasetReader({self.name!r}, shards={len(self.urls)})"

    def iter_shard(self, index: int) -> Iterator[RawItem]:
        """The raw samples of shard ``index``, in the order of the tar."""
        url = self.urls[index]
        with open_url(url, self.storage_options) as stream:
            for position, (key, fields) in enumerate(group_by_key(tar_members(stream, url), url)):
                yield RawItem(key, url, (index << 32) | position, fields)

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one sample: its members decoded and mapped by the entry's record layout."""
        members = dict(decode_member(ext, data) for ext, data in item.payload.items())
        record = self.record
        out: dict[str, Any] = {"__key__": item.key, "__shard__": item.shard, "__uid__": item.uid}
        out["image"] = members.get(record.image) if record.image else None
        out["caption"] = record_caption(members, (record.caption,)) if record.caption else None
        if record.label:
            out["label"] = members.get(record.label)
        if record.key and record.key in members:
            out["__key__"] = str(members[record.key])
        if record.embedding:
            out["embedding"] = members.get(record.embedding)
        out["members"] = members
        return out
