"""Reading shard URLs through fsspec: streams in large blocks, byte ranges many at once, retries.

Every read of storage goes through here, so storage errors are translated
once: a missing object is ``FileNotFoundError(url)``, a transient failure
(connection reset or cut mid-body, 429, 5xx) is retried with backoff up to
``RETRIES`` times, and what still fails is a :class:`ShardError` naming the
URL. Remote reads are latency-bound (30-100 ms to the first byte on a
bucket), so a stream is opened with a read-ahead block of several MB and a
batch's byte ranges are fetched concurrently (gcsfs runs them as one
asyncio gather).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import random
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeVar

from datacat.errors import BackendUnavailable, ShardError, storage_failure
from datacat.limits import connect_timeout, deadline, read_timeout
from datacat.redact import redact, remember

__all__ = [
    "BLOCK_SIZE",
    "RETRIES",
    "failed",
    "filesystem",
    "is_remote",
    "object_size",
    "open_url",
    "read_bytes",
    "read_many",
    "read_ranges",
    "retry_count",
    "too_slow",
    "transient",
    "with_retries",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOCK_SIZE = 8 * 2**20
"""Read-ahead of a remote stream: one request per 8 MB instead of one per ``read()`` call."""
RETRIES = 6
"""Tries after the first for a transient storage error, with exponential backoff from 0.1 s."""

_retries = 0
_retries_lock = threading.Lock()
_made: set[tuple[str, str, int]] = set()  # storage clients made in this process: (protocol, options, pid)
_last_client_error = ""  # what gcsfs last retried after, for a deadline's error message


def retry_count() -> int:
    """Transient storage errors retried by this process so far, by datacat or by gcsfs itself."""
    return _retries


def is_remote(url: str) -> bool:
    """Whether ``url`` names an object behind a network (anything but a local path or ``file://``)."""
    return "://" in url and not url.startswith("file://")


def transient(exc: BaseException) -> bool:
    """Whether a storage error is worth retrying: a cut connection, a timeout, 429 or 5xx."""
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    code = getattr(exc, "code", None) or getattr(exc, "status", None)
    if isinstance(code, int):
        return code == 408 or code == 429 or code >= 500
    # aiohttp (gcsfs) and the C++ GCS client of array_record name what went wrong only in text and type.
    name = type(exc).__name__
    text = str(exc).lower()
    return (
        name in ("ClientPayloadError", "ServerDisconnectedError", "ClientOSError", "ContentLengthError")
        or "unavailable" in text
        or "connection reset" in text
        or "connection closed" in text
        or "response payload is not completed" in text
        or "server disconnected" in text
        or "timed out" in text
        or "503" in text
        or "429" in text
    )


def failed(url: str, exc: BaseException, doing: str = "cannot read") -> ShardError:
    """The ShardError for a storage failure at ``url``: the client's words, redacted, and what to check."""
    return ShardError(
        f"{doing} {url}: {type(exc).__name__}: {redact(exc)}. Check the URL, the network and the credentials "
        "in storage_options",
        url=url,
    )


def with_retries(read: Callable[[], T], url: str, *, any_error: bool = False) -> T:
    """``read()``, retried with backoff while it fails transiently; then a ShardError naming ``url``.

    A storage failure that is not transient is a ShardError at once; an
    exception from anything else (a bug) propagates as it is.
    ``any_error``: retry every error but a missing object. A client that
    parses what it reads (array_record's) reports a body cut short by the
    network as a damaged file; only a retry tells the two apart.
    """
    global _retries
    delay = 0.1
    limit, started = read_timeout(), time.monotonic()
    for attempt in range(RETRIES + 1):
        try:
            return read()
        except Exception as exc:  # sorted below: only transient errors are retried, the rest re-raised as they are
            if isinstance(exc, FileNotFoundError):
                raise _not_found(url) from None
            if _fs_timeout(exc) or (transient(exc) and time.monotonic() - started + delay >= limit and is_remote(url)):
                raise too_slow(url, limit) from None
            if not (transient(exc) or (any_error and not isinstance(exc, ShardError))):
                if isinstance(exc, ShardError) or not storage_failure(exc):
                    raise
                raise failed(url, exc) from None  # the client's own text may hold a credential: not chained
            if attempt == RETRIES:
                raise ShardError(
                    f"{url}: still failing after {RETRIES} retries: {type(exc).__name__}: {redact(exc)}", url=url
                ) from None
            with _retries_lock:
                _retries += 1
            log.info("retrying %s after %s: %s", url, type(exc).__name__, redact(exc))
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 5.0)
    raise AssertionError("unreachable")


def too_slow(url: str, seconds: float) -> ShardError:
    """The error for a read of ``url`` that passed its deadline: the storage client's last complaint, and the fix."""
    last = f" (the storage client was retrying after: {redact(_last_client_error)})" if _last_client_error else ""
    return ShardError(
        f"{url}: no answer within {seconds:.0f} s{last}. The storage is unreachable or stalled: check the URL, "
        "the network and the credentials (DATACAT_READ_TIMEOUT sets the deadline)",
        url=url,
    )


def _not_found(url: str) -> FileNotFoundError:
    return FileNotFoundError(2, f"shard not found: {url}; check the entry's root or its missing list", url)


class _ClientRetries(logging.Filter):
    """Counts the retries gcsfs makes on its own (it logs each at DEBUG) and passes on what the user would see."""

    def __init__(self, passes: int) -> None:
        super().__init__()
        self.passes = passes

    def filter(self, record: logging.LogRecord) -> bool:
        global _retries, _last_client_error
        message = record.getMessage()
        if record.levelno == logging.DEBUG and "retrying after exception" in message:
            with _retries_lock:
                _retries += 1
            _last_client_error = message.split("retrying after exception: ", 1)[-1]
        if "out of retries on exception" in message or "non-retriable exception" in message:
            return False  # datacat raises one error naming the URL; the client's traceback would only repeat it
        return record.levelno >= self.passes


def _count_client_retries() -> None:
    client = logging.getLogger("gcsfs")
    if any(isinstance(f, _ClientRetries) for f in client.filters):
        return
    client.addFilter(_ClientRetries(client.getEffectiveLevel()))
    client.setLevel(logging.DEBUG)


def _fs_timeout(exc: BaseException) -> bool:
    # fsspec's own deadline error; fsspec is imported with the first filesystem, so none exists before.
    exceptions = sys.modules.get("fsspec.exceptions")
    return exceptions is not None and isinstance(exc, exceptions.FSTimeoutError)


def filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem and path of ``url``; a client that cannot be made is a ShardError naming the URL."""
    import fsspec  # imported with the first read: validating and describing an entry reads nothing

    options = dict(storage_options or {})
    if url.startswith(("gs://", "gcs://")):
        options.setdefault("requests_timeout", read_timeout())  # each HTTP request of a streamed read, too
    client = (url.split("://", 1)[0], repr(sorted(options.items())), os.getpid())
    try:
        if not is_remote(url) or client in _made:  # fsspec hands back its cached instance at once
            return fsspec.core.url_to_fs(url, **options)  # type: ignore[no-any-return]
        remember(options)  # once per client and process: a worker that was spawned learns them here
        _count_client_retries()
        # Making a client can itself wait on the network (gcsfs looks for credentials, a metadata
        # server among them): bounded like a read. fsspec caches the client once it exists.
        making = concurrent.futures.Future[tuple[Any, str]]()

        def make() -> None:
            try:
                making.set_result(fsspec.core.url_to_fs(url, **options))
            except BaseException as exc:  # handed to the caller below, whatever it is
                making.set_exception(exc)

        threading.Thread(target=make, name="datacat-storage-client", daemon=True).start()
        try:
            made = making.result(timeout=connect_timeout())
            _made.add(client)
            return made
        except concurrent.futures.TimeoutError:
            raise ShardError(
                f"cannot connect to {url}: the storage client was not ready within {connect_timeout():.0f} s "
                "(looking for credentials, or the network is down). Check the network and the credentials in "
                "storage_options (DATACAT_CONNECT_TIMEOUT sets the deadline)",
                url=url,
            ) from None
    except ImportError as exc:
        extra = "gcs" if url.startswith(("gs://", "gcs://")) else None
        hint = f"pip install 'datacat[{extra}]'" if extra else f"install the fsspec backend for it ({exc})"
        raise BackendUnavailable(f"reading {url} needs {exc.name or 'its fsspec backend'}: {hint}") from None
    except (ValueError, TypeError) as exc:  # the client refused its options (a malformed token, an unknown key)
        raise failed(url, exc, "cannot connect to") from None
    except Exception as exc:  # sorted here: storage failures (a credential check over the network) are translated
        if not storage_failure(exc):
            raise
        raise failed(url, exc, "cannot connect to") from None


def _local(url: str) -> str:
    """The path of a local URL, refused unless it is a regular file: a FIFO or device would block forever."""
    return _local_stat(url)[0]


def _local_stat(url: str) -> tuple[str, os.stat_result]:
    """The path of a local URL and its ``stat``, refused unless it is a regular file (see :func:`_local`)."""
    path = url.removeprefix("file://")
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise _not_found(url) from None
    if not stat.S_ISREG(info.st_mode):
        raise ShardError(f"{url} is not a regular file (a folder, FIFO or device?); a shard must be a file", url=url)
    return path, info


def open_url(url: str, storage_options: Mapping[str, Any] | None = None, *, block_size: int = BLOCK_SIZE) -> IO[bytes]:
    """``url`` opened for binary reading; remote objects read ahead ``block_size`` bytes per request."""
    try:
        if not is_remote(url):
            return open(_local(url), "rb")
        fs, path = filesystem(url, storage_options)
        stream: IO[bytes] = with_retries(
            lambda: fs.open(path, "rb", block_size=block_size, cache_type="readahead"), url
        )
        return stream
    except FileNotFoundError:
        raise _not_found(url) from None
    except (IsADirectoryError, PermissionError) as exc:
        raise ShardError(f"cannot open {url}: {redact(exc)}", url=url) from None


def object_size(url: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """The size in bytes of the object at ``url`` (one metadata request when remote), retried, under the deadline."""
    if not is_remote(url):
        try:
            return os.path.getsize(_local(url.removeprefix("file://")))
        except FileNotFoundError:
            raise _not_found(url) from None
    fs, path = filesystem(url, storage_options)
    from fsspec.asyn import sync

    get_object = getattr(fs, "_get_object", None)  # gcsfs: the object's metadata alone (its info() lists too)
    if get_object is None:
        return int(with_retries(lambda: fs.info(path, **deadline(fs))["size"], url))
    return int(with_retries(lambda: sync(fs.loop, get_object, path, **deadline(fs))["size"], url))


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole content of ``url``."""
    if not is_remote(url):
        with open(_local(url), "rb") as f:
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
    for i, (url, _, _) in enumerate(requests):
        (remote if is_remote(url) else local).append(i)
    if local:
        _read_local_ranges(requests, local, out)
    if not remote:
        return out
    fs, _ = filesystem(requests[remote[0]][0], storage_options)
    from fsspec.exceptions import FSTimeoutError

    pending = remote
    global _retries
    delay = 0.1
    limit = read_timeout() if seconds is None else seconds
    started = time.monotonic()
    for attempt in range(RETRIES + 1):
        paths = [fs._strip_protocol(requests[i][0]) for i in pending]
        try:
            results = fs.cat_ranges(
                paths,
                [requests[i][1] for i in pending],
                [requests[i][2] for i in pending],
                on_error="return",
                **deadline(fs, max(limit - (time.monotonic() - started), 0.01)),
            )
        except FSTimeoutError:
            for i in pending:
                out[i] = too_slow(requests[i][0], limit)
            break
        again = []
        for i, result in zip(pending, results, strict=True):
            url = requests[i][0]
            if not isinstance(result, Exception):
                out[i] = result
            elif isinstance(result, FileNotFoundError):
                out[i] = _not_found(url)
            elif transient(result) and attempt < RETRIES:
                again.append(i)
            else:
                out[i] = failed(url, result, f"cannot read bytes {requests[i][1]}-{requests[i][2]} of")
        if again and time.monotonic() - started + delay >= limit:
            for i in again:
                out[i] = too_slow(requests[i][0], limit)
            break
        if not again:
            break
        with _retries_lock:
            _retries += len(again)
        log.info("retrying %d range read(s) of %s", len(again), requests[again[0]][0])
        time.sleep(delay * (1 + random.random()))
        delay = min(delay * 2, 5.0)
        pending = again
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
