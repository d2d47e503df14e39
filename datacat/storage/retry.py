"""The one retry loop of storage reads: transient errors tried again with backoff, within the read's deadline.

A transient error (:class:`~datacat.storage.errors.Meaning`) is retried up
to ``RETRIES`` times with exponential backoff from 0.1 s, never past the
deadline (``limits.read_timeout()``); what still fails is a ``ShardError``
naming the URL. gcsfs, s3fs and botocore retry on their own too; those
retries are counted from their logs, so :func:`retry_count` reports all.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from datacat.errors import DatacatError, ShardError
from datacat.limits import read_timeout
from datacat.redact import redact
from datacat.storage.errors import Meaning, classify, raise_mapped, storage_error, too_slow

__all__ = ["RETRIES", "count_client_retries", "retry_count", "retry_each", "with_retries"]

log = logging.getLogger(__name__)
T = TypeVar("T")
K = TypeVar("K")

RETRIES = 6
"""Tries after the first for a transient storage error, with exponential backoff from 0.1 s."""

_retries = 0
_retries_lock = threading.Lock()
_last_client_error = ""  # what a storage client last retried after, for a deadline's error message


def retry_count() -> int:
    """Transient storage errors retried by this process so far, by datacat or by the storage client itself."""
    return _retries


def _counted(n: int) -> None:
    global _retries
    with _retries_lock:
        _retries += n


def retry_each(
    keys: Sequence[K],
    fetch: Callable[[Sequence[K], float], Sequence[T | BaseException]],
    url_of: Callable[[K], str],
    *,
    seconds: float | None = None,
    any_error: bool = False,
    doing: Callable[[K], str] = lambda _: "cannot read",
) -> list[T | Exception]:
    """``fetch(keys, seconds_left)``, then again for the keys whose result was a transient error; one result a key.

    ``fetch`` answers each key with its value or its exception. A key still
    failing after ``RETRIES`` tries or at the deadline (``seconds``, default
    ``limits.read_timeout()``) is answered with datacat's error naming its
    URL; an exception of no known storage type is raised untouched, as is
    datacat's own. ``any_error``: every error but a missing object is
    transient (a client that parses what it reads, array_record's, reports
    a body cut short by the network as a damaged file; only a retry tells).
    """
    limit = read_timeout() if seconds is None else seconds
    started, delay = time.monotonic(), 0.1
    out: list[T | Exception] = [ShardError("not read")] * len(keys)
    pending = list(range(len(keys)))
    for attempt in range(RETRIES + 1):
        results = fetch([keys[i] for i in pending], max(limit - (time.monotonic() - started), 0.01))
        again: list[tuple[int, BaseException]] = []
        for i, result in zip(pending, results, strict=True):
            if not isinstance(result, BaseException):
                out[i] = result
                continue
            meaning = classify(result)
            if (
                any_error
                and meaning not in (Meaning.MISSING, Meaning.DEADLINE)
                and not isinstance(result, DatacatError)
            ):
                meaning = Meaning.TRANSIENT
            if meaning is None:
                raise result
            if meaning is Meaning.TRANSIENT:
                again.append((i, result))
            elif meaning is Meaning.DEADLINE:
                out[i] = too_slow(url_of(keys[i]), limit, _last_client_error)
            else:
                out[i] = storage_error(url_of(keys[i]), result, meaning, doing(keys[i]))
        if not again:
            break
        late = time.monotonic() - started + delay >= limit
        for i, exc in again if late or attempt == RETRIES else ():
            url = url_of(keys[i])
            out[i] = (
                too_slow(url, limit, _last_client_error)
                if late
                else ShardError(
                    f"{url}: still failing after {RETRIES} retries: {type(exc).__name__}: {redact(exc)}", url=url
                )
            )
        if late or attempt == RETRIES:
            break
        _counted(len(again))
        first, exc = again[0]
        log.info(
            "retrying %d read(s) of %s after %s: %s", len(again), url_of(keys[first]), type(exc).__name__, redact(exc)
        )
        time.sleep(delay * (1 + random.random()))
        delay = min(delay * 2, 5.0)
        pending = [i for i, _ in again]
    return out


def with_retries(read: Callable[[], T], url: str, *, any_error: bool = False, seconds: float | None = None) -> T:
    """``read()``, retried with backoff while it fails transiently; then datacat's error naming ``url``.

    A known storage error that is not transient is datacat's at once (a
    missing object ``FileNotFoundError``, anything else a ``ShardError``);
    an exception of no known storage type (a bug) propagates as it is.
    ``any_error`` as in :func:`retry_each`.
    """
    raised: list[BaseException] = []

    def attempt(_: Sequence[str], left: float) -> list[T | BaseException]:
        raised.clear()
        try:
            return [read()]
        except Exception as exc:  # sorted by retry_each: known storage errors mapped, the rest re-raised untouched
            raised.append(exc)
            return [exc]

    (result,) = retry_each([url], attempt, lambda u: u, seconds=seconds, any_error=any_error)
    if isinstance(result, Exception):
        cause = raised[0] if raised else result
        if cause is result:
            raise result
        raise_mapped(result, cause)
    return result


_CLIENT_RETRY_LOGS = {
    # logger: the start of the DEBUG message it logs for each retry it makes itself.
    "gcsfs": "retrying after exception",  # anywhere in the message
    "s3fs": "Retryable error",  # s3fs's own loop, after botocore's retries ended
    "botocore.retryhandler": "Retry needed, action of",  # botocore's retries (legacy mode, the default)
    "botocore.retries.standard": "Retry needed, retrying request",  # botocore's retries (standard mode)
}
_CLIENT_ERROR_LOGS = {
    # logger: the start of the DEBUG message saying what a client retries after, for a deadline's error.
    "s3fs": "Retryable error",
    "botocore.retryhandler": "retry needed",
}


class _ClientRetries(logging.Filter):
    """Counts the retries a storage client makes on its own (it logs each at DEBUG) and passes on what the user would see."""

    def __init__(self, passes: int, retry: str, error: str | None) -> None:
        super().__init__()
        self.passes, self.retry, self.error = passes, retry, error

    def filter(self, record: logging.LogRecord) -> bool:
        global _last_client_error
        if record.name == "gcsfs":
            message = record.getMessage()
            if record.levelno == logging.DEBUG and "retrying after exception" in message:
                _counted(1)
                _last_client_error = message.split("retrying after exception: ", 1)[-1]
            if "out of retries on exception" in message or "non-retriable exception" in message:
                return False  # datacat raises one error naming the URL; the client's traceback would only repeat it
            return record.levelno >= self.passes
        if record.levelno == logging.DEBUG and isinstance(record.msg, str):  # not formatted unless it is one
            if record.msg.startswith(self.retry):
                _counted(1)
            if self.error is not None and record.msg.startswith(self.error):
                _last_client_error = record.getMessage()
        return record.levelno >= self.passes


def count_client_retries() -> None:
    """Starts counting the retries storage clients make themselves (once a process), their logs as quiet as they were."""
    for name, retry in _CLIENT_RETRY_LOGS.items():
        client = logging.getLogger(name)
        if any(isinstance(f, _ClientRetries) for f in client.filters):
            continue
        client.addFilter(_ClientRetries(client.getEffectiveLevel(), retry, _CLIENT_ERROR_LOGS.get(name)))
        client.setLevel(logging.DEBUG)
