"""Reads of shard URLs: streams in large blocks, byte ranges many at once, local files kept open.

A remote shard with a copy in the node-local shard cache
(:mod:`datacat.storage.shard_cache`) is read from that copy, with no request.
Every read goes through the storage boundary (:mod:`datacat.storage.errors`)
and the retry loop (:mod:`datacat.storage.retry`) under a deadline. Remote
reads are latency-bound (30-100 ms to the first byte on a bucket), so a
stream is opened with a read-ahead block of several MB and a batch's byte
ranges are fetched concurrently (gcsfs runs them as one asyncio gather).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from typing import IO, Any

from datacat.errors import ShardError
from datacat.limits import deadline
from datacat.storage.clients import filesystem, is_remote
from datacat.storage.errors import mapped_errors, not_found
from datacat.storage.retry import retry_each, with_retries
from datacat.storage.shard_cache import served

__all__ = ["BLOCK_SIZE", "object_info", "object_size", "open_url", "read_bytes", "read_many", "read_ranges"]

BLOCK_SIZE = 8 * 2**20
"""Read-ahead of a remote stream: one request per 8 MB instead of one per ``read()`` call."""
_Range = tuple[str, int, "int | None"]  # a URL and the bytes [start, end) of it; end None: to its end


def _local(url: str) -> str:
    """The path of a local URL, refused unless it is a regular file: a FIFO or device would block forever."""
    return _local_stat(url)[0]


def _local_stat(url: str) -> tuple[str, os.stat_result]:
    """The path of a local URL and its ``stat``, refused unless it is a regular file (see :func:`_local`)."""
    path = url.removeprefix("file://")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise not_found(url) from None
    if not stat.S_ISREG(info.st_mode):
        raise ShardError(f"{url} is not a regular file (a folder, FIFO or device?); a shard must be a file", url=url)
    return path, info


def open_url(url: str, storage_options: Mapping[str, Any] | None = None, *, block_size: int = BLOCK_SIZE) -> IO[bytes]:
    """``url`` opened for binary reading; remote objects read ahead ``block_size`` bytes per request."""
    if not is_remote(url):
        with mapped_errors(url, "cannot open"):
            return open(_local(url), "rb")
    if (copy := served(url)) is not None:
        with contextlib.suppress(OSError):  # evicted since: from the bucket
            return open(copy, "rb")
    fs, path = filesystem(url, storage_options)
    known: dict[str, Any] = {}
    if "s3" in _protocols(fs):  # s3fs's open asks for the object's size with no deadline: asked here, with one
        known["size"] = object_size(url, storage_options)
    stream: IO[bytes] = with_retries(
        lambda: fs.open(path, "rb", block_size=block_size, cache_type="readahead", **known), url
    )
    return stream


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def object_size(url: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """The size in bytes of the object at ``url`` (one metadata request when remote), retried, under the deadline."""
    if not is_remote(url):
        with mapped_errors(url):
            return os.path.getsize(_local(url))
    if (copy := served(url)) is not None:
        with contextlib.suppress(OSError):
            return os.path.getsize(copy)
    return int(object_info(url, storage_options)["size"])


def object_info(url: str, storage_options: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """The store's metadata of the remote object at ``url`` (``size``; ``md5Hash`` on GCS, ``ETag`` on S3), retried."""
    fs, path = filesystem(url, storage_options)
    from fsspec.asyn import sync

    get_object = getattr(fs, "_get_object", None)  # gcsfs: the object's metadata alone (its info() lists too)
    if get_object is None:
        info: Mapping[str, Any] = with_retries(lambda: fs.info(path, **deadline(fs)), url)
        return info
    meta: Mapping[str, Any] = with_retries(lambda: sync(fs.loop, get_object, path, **deadline(fs)), url)
    return meta


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole content of ``url``."""
    if not is_remote(url):
        with mapped_errors(url), open(_local(url), "rb") as f:
            return f.read()
    if (copy := served(url)) is not None:
        with contextlib.suppress(OSError), open(copy, "rb") as f:
            return f.read()
    fs, path = filesystem(url, storage_options)
    return with_retries(lambda: fs.cat_file(path, **deadline(fs)), url)  # type: ignore[no-any-return]


def read_ranges(
    requests: Sequence[tuple[str, int, int | None]],
    storage_options: Mapping[str, Any] | None = None,
    *,
    seconds: float | None = None,
) -> list[bytes | Exception]:
    """The bytes ``[start, end)`` of each ``(url, start, end)`` (end None: to the end), fetched concurrently.

    The fetch has a deadline (``seconds``, default ``limits.read_timeout()``).

    A range that cannot be read after retries is returned as its exception
    (``FileNotFoundError`` or ``ShardError`` naming the URL), so one bad
    object does not cost the others.
    """
    out: list[bytes | Exception] = [b""] * len(requests)
    remote: list[int] = []
    local: list[int] = []
    cached: list[int] = []
    copies: dict[str, str | None] = {}
    for i, (url, _, _) in enumerate(requests):
        if not is_remote(url):
            local.append(i)
        elif (copies[url] if url in copies else copies.setdefault(url, served(url))) is not None:
            cached.append(i)
        else:
            remote.append(i)
    if local:
        _read_local_ranges(requests, local, out)
    if cached:  # read from the shard cache; a copy evicted since is read from the bucket
        _read_local_ranges([(copies.get(url) or url, start, end) for url, start, end in requests], cached, out)
        remote = sorted(remote + [i for i in cached if isinstance(out[i], Exception)])
    if not remote:
        return out
    fs, _ = filesystem(requests[remote[0]][0], storage_options)

    def fetch(ranges: Sequence[_Range], left: float) -> Sequence[bytes | BaseException]:
        try:
            return fs.cat_ranges(  # type: ignore[no-any-return]
                [fs._strip_protocol(url) for url, _, _ in ranges],
                [start for _, start, _ in ranges],
                [end for _, _, end in ranges],
                on_error="return",
                **deadline(fs, left),
            )
        except Exception as exc:  # the whole call failed (its deadline): each range's answer; retry_each sorts it
            return [exc] * len(ranges)

    results = retry_each(
        [requests[i] for i in remote],
        fetch,
        lambda r: r[0],
        seconds=seconds,
        doing=lambda r: f"cannot read bytes {r[1]}-{r[2]} of",
    )
    for i, result in zip(remote, results, strict=True):
        out[i] = result
    return out


def read_many(urls: Sequence[str], storage_options: Mapping[str, Any] | None = None) -> list[bytes | Exception]:
    """The whole content of each of ``urls``, fetched concurrently; an object that cannot be read is its exception."""
    out: list[bytes | Exception] = []
    for url in urls:
        if is_remote(url):
            out.append(b"")
            continue
        try:
            out.append(read_bytes(url))
        except (FileNotFoundError, ShardError) as exc:
            out.append(exc)
        except OSError as exc:
            out.append(ShardError(f"cannot read {url}: {exc}", url=url))
    remote = [i for i, url in enumerate(urls) if is_remote(url)]
    if remote:
        sizes = read_ranges([(urls[i], 0, None) for i in remote], storage_options)
        for i, data in zip(remote, sizes, strict=True):
            out[i] = data
    return out


def _read_local_ranges(
    requests: Sequence[tuple[str, int, int | None]], local: Sequence[int], out: list[bytes | Exception]
) -> None:
    """Reads requests ``local`` into their places in ``out``: each file taken once for all its ranges.

    A batch of shuffled records touches a few shards many times each: one
    ``stat`` a file per call, not one a record.
    """
    ranges: dict[str, list[int]] = {}
    for i in local:
        ranges.setdefault(requests[i][0].removeprefix("file://"), []).append(i)
    for path, indices in ranges.items():
        try:
            file = _OPEN_FILES.take(path)
        except (FileNotFoundError, ShardError) as exc:
            for i in indices:
                out[i] = exc
            continue
        except OSError as exc:
            for i in indices:
                out[i] = ShardError(f"cannot open {path}: {exc}", url=path)
            continue
        try:
            for i in indices:
                out[i] = _read_range(file.fd, path, requests[i][1], requests[i][2])
        finally:
            _OPEN_FILES.give(file)


def _read_range(fd: int, path: str, start: int, end: int | None) -> bytes | Exception:
    try:
        if end is None:
            end = os.fstat(fd).st_size
        data = os.pread(fd, end - start, start)
    except OSError as exc:
        return ShardError(f"cannot read bytes {start}-{end} of {path}: {exc}", url=path)
    if len(data) != end - start:
        return ShardError(
            f"{path} ends before byte {end} (read {len(data)} of {end - start} from {start}); re-copy it", url=path
        )
    return data


class _File:
    """An open local shard: its fd, which file it is (device, inode), and how many threads are reading it."""

    __slots__ = ("fd", "identity", "readers", "retired")

    def __init__(self, fd: int) -> None:
        info = os.fstat(fd)
        self.fd, self.identity, self.readers, self.retired = fd, (info.st_dev, info.st_ino), 0, False


class _OpenFiles:
    """This process's open local shards, so reading ranges is a ``stat`` and a ``pread`` each, not an open and close too.

    A shuffled epoch reads each record of a shard at a different time:
    opening and closing the file for each cost ~5 us of a ~40 us read of a
    sample's span (torch over tars, one process). Each :func:`read_ranges`
    call still stats the path once, so a shard deleted since is not found,
    and one replaced since (a new file renamed over it) is opened afresh.
    At most ``limit`` stay open, the least recently read closed first (once
    no thread reads it).
    A forked child closes its copies of the parent's and opens its own
    (:meth:`after_fork`: a thread of the parent may have held the lock).
    """

    def __init__(self, limit: int = 64) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: dict[str, _File] = {}  # by path, least recently read first

    def take(self, path: str) -> _File:
        """``path`` open (refused unless a regular file), held until :meth:`give`."""
        local, info = _local_stat(path)
        with self._lock:
            file = self._open.pop(local, None)
            if file is not None and file.identity != (info.st_dev, info.st_ino):
                self._retire(file)  # replaced since it was opened
                file = None
            if file is None:
                file = _File(os.open(local, os.O_RDONLY))
            self._open[local] = file
            file.readers += 1
            while len(self._open) > self.limit:
                self._retire(self._open.pop(next(iter(self._open))))
            return file

    def give(self, file: _File) -> None:
        """``file`` is no longer read by this thread."""
        with self._lock:
            file.readers -= 1
            if file.retired and not file.readers:
                os.close(file.fd)

    def _retire(self, file: _File) -> None:
        file.retired = True
        if not file.readers:
            os.close(file.fd)

    def after_fork(self) -> None:
        """In a forked child: a new lock, and the parent's files closed (the child's copies only)."""
        self._lock = threading.Lock()
        for file in self._open.values():
            with contextlib.suppress(OSError):
                os.close(file.fd)
        self._open = {}


_OPEN_FILES = _OpenFiles()
os.register_at_fork(after_in_child=_OPEN_FILES.after_fork)
