"""ArrayRecord shards as files: opened by array_record's C++ client, counted, their chunk index read.

What the reader (:mod:`datacat.formats.array_record`) and ``datacat
verify`` share. The C++ client is imported where a shard is opened: only
array_record entries need it, and validating an entry imports nothing of it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datacat.cache import cache_dir
from datacat.errors import ShardError
from datacat.formats import riegeli
from datacat.limits import connect_timeout
from datacat.storage import is_remote, object_size, read_ranges, with_retries
from datacat.storage.manifests import Manifest, ShardFacts, load_manifest, save_index, save_manifest

if TYPE_CHECKING:
    from datacat.plan import Plan

log = logging.getLogger(__name__)

__all__ = [
    "check_reachable",
    "count_elsewhere",
    "count_records",
    "index_dir",
    "index_shard",
    "open_shard",
    "remember_counts",
    "used_here",
]


def index_dir() -> Path:
    """Where remote shards' chunk indexes are kept."""
    return cache_dir() / "ar-index"


def used_here() -> bool:
    """Whether array_record's C++ library is loaded in this process: a child forked after it ran crashes reading.

    Its readers and writers keep process-wide native state (a reader's pool
    of ~64 threads) that a forked child inherits half-alive: seen here, the
    child segfaults on its first read, after this process read or only
    wrote ArrayRecords. datacat loads the library only to read or write, so
    loaded is taken as used (by datacat or by anything else in the process).
    """
    return "array_record.python.array_record_module" in sys.modules


class _NotOpened(RuntimeError):
    """The C++ reader's status after a failed open."""


def open_shard(url: str) -> Any:
    """array_record's C++ reader of one shard, open; a missing or damaged shard is an error naming it."""
    from array_record.python import array_record_module

    def attempt() -> Any:
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
            raise FileNotFoundError(2, url, url)
        raise _NotOpened(status)

    try:  # remote: a footer read cut short by the network looks like a damaged file; only a retry tells
        return with_retries(attempt, url, any_error=is_remote(url))
    except _NotOpened as exc:
        status = str(exc)
    except ShardError as exc:
        status = str(exc.__cause__ or exc)
    if "No such file" in status or "NOT_FOUND" in status:
        raise FileNotFoundError(2, f"shard not found: {url}; check the entry's root or its missing list", url)
    raise ShardError(
        f"ArrayRecord shard {url} cannot be read ({status or 'no valid footer'}): it is truncated or not an "
        "ArrayRecord file. Re-copy it, or add it to the entry's missing list.",
        url=url,
    )


def count_records(url: str) -> int:
    """The number of records in one shard."""
    reader = open_shard(url)
    try:
        return int(reader.num_records())
    finally:
        reader.close()


def count_elsewhere(urls: Sequence[str]) -> list[int]:
    """The records of each shard, counted in a short-lived child process, all shards at once.

    Counting in this process would leave array_record's C++ client state
    here, and a forked worker then crashes: the loader would have to start
    its workers from a forkserver, seconds slower. The child costs ~0.3 s.
    """
    code = (
        "import json, sys\n"
        "from datacat.formats.ar_shards import _count_all\n"
        "print('COUNTS ' + json.dumps(_count_all(json.loads(sys.argv[1]))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(urls))], capture_output=True, text=True, check=False, timeout=3600
    )
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("COUNTS ")), None)
    if line is None:
        raise ShardError(
            f"counting the records of {urls[0]} and {len(urls) - 1} more shard(s) failed: {done.stderr[-800:]}"
        )
    counts: list[int] = []
    for url, (kind, value) in zip(urls, json.loads(line[len("COUNTS ") :]), strict=True):
        if kind == "missing":
            raise FileNotFoundError(2, f"shard not found: {url}; check the entry's root or its missing list", url)
        if kind == "error":
            raise ShardError(value)
        counts.append(int(value))
    return counts


def _count_all(urls: list[str]) -> list[tuple[str, Any]]:
    def one(url: str) -> tuple[str, Any]:
        try:
            return "count", count_records(url)
        except FileNotFoundError:
            return "missing", url
        except ShardError as exc:
            return "error", str(exc)

    with concurrent.futures.ThreadPoolExecutor(min(16, len(urls))) as pool:
        return list(pool.map(one, urls))


def remember_counts(plan: Plan, counts: Sequence[int | None]) -> None:
    """Keeps counted records in the cache's manifest: the next open (and describe) reads no footer."""
    manifest = load_manifest(plan.manifest) or Manifest(plan.manifest, plan.name, plan.root, {})
    for shard, n in zip(plan.shards, counts, strict=True):
        if n is not None and shard.name not in manifest.shards:
            manifest.shards[shard.name] = ShardFacts(shard.name, int(n), url=shard.url)
    try:
        save_manifest(manifest)
    except OSError as exc:
        log.warning("cannot write the manifest of %s: %s", plan.name, exc)


def index_shard(url: str, name: str, storage_options: dict[str, Any], *, size: int | None = None) -> ShardFacts | None:
    """Reads the chunk index of one remote shard (``size`` bytes, asked for when None) into the cache.

    Two requests at most (the size, then the last 1 MiB: postscript and
    footer). None when its chunks are not decoded in Python: read it with
    array_record's client.
    """
    if size is None:
        size = object_size(url, storage_options)
    start = size - riegeli.tail_size(size)
    (tail,) = read_ranges([(url, start, size)], storage_options)
    if isinstance(tail, Exception):
        raise tail
    try:
        try:
            index = riegeli.read_index(tail, size)
        except riegeli.NeedMore as more:  # a footer of more than ~80k chunks
            (head,) = read_ranges([(url, more.offset, start)], storage_options)
            if isinstance(head, Exception):
                raise head from None
            index = riegeli.read_index(tail, size, head)
    except riegeli.Unsupported as exc:
        log.info("%s is read by array_record's own client: %s", url, exc)
        return None
    except ValueError as exc:
        raise ShardError(
            f"ArrayRecord shard {url} cannot be read ({exc}): it is truncated or not an ArrayRecord file. "
            "Re-copy it, or add it to the entry's missing list.",
            url=url,
        ) from None
    index_file = save_index("ar-index", index.to_array(), url)
    return ShardFacts(name, len(index), url=url, bytes=size, index=index_file)


def check_reachable(url: str, storage_options: dict[str, Any]) -> None:
    """Raises unless fsspec can read remote ``url``: array_record's own GCS client would retry for minutes.

    One ranged read of one byte: it proves the object exists and the
    credentials work, with no listing (an ``info`` call lists too).
    """
    (result,) = read_ranges([(url, 0, 1)], storage_options, seconds=connect_timeout())
    if isinstance(result, FileNotFoundError | ShardError):
        raise result  # it names the URL and what to check
    if isinstance(result, Exception):
        raise ShardError(
            f"cannot reach {url}: {result}. Check the network and credentials, or set DATACAT_ROOT (or root=) "
            "to a local copy",
            url=url,
        ) from result
