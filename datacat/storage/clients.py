"""Storage clients: the fsspec filesystem of a URL, made once a process within the connect deadline."""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Mapping
from typing import Any

from datacat.errors import BackendUnavailable, ShardError
from datacat.limits import connect_timeout, read_timeout
from datacat.redact import remember
from datacat.storage.errors import mapped_errors
from datacat.storage.retry import count_client_retries

__all__ = ["filesystem", "is_remote"]

_made: set[tuple[str, str, int]] = set()  # storage clients made in this process: (protocol, options, pid)


def is_remote(url: str) -> bool:
    """Whether ``url`` names an object behind a network (anything but a local path or ``file://``)."""
    return "://" in url and not url.startswith("file://")


def filesystem(url: str, storage_options: Mapping[str, Any] | None) -> tuple[Any, str]:
    """The fsspec filesystem and path of ``url``; a client that cannot be made is a ShardError naming the URL."""
    options = dict(storage_options or {})
    if url.startswith(("gs://", "gcs://")):
        options.setdefault("requests_timeout", read_timeout())  # each HTTP request of a streamed read, too
    client = (url.split("://", 1)[0], repr(sorted(options.items())), os.getpid())
    try:
        import fsspec  # imported with the first read: validating and describing an entry reads nothing

        # The client refusing its options (a malformed token, an unknown key) raises ValueError or TypeError.
        with mapped_errors(url, "cannot connect to", refused=(ValueError, TypeError)):
            if not is_remote(url) or client in _made:  # fsspec hands back its cached instance at once
                return fsspec.core.url_to_fs(url, **options)  # type: ignore[no-any-return]
            remember(options)  # once per client and process: a worker that was spawned learns them here
            count_client_retries()
            made = _make(url, options)
            _made.add(client)
            return made
    except ImportError as exc:
        extra = "gcs" if url.startswith(("gs://", "gcs://")) else "s3" if url.startswith(("s3://", "s3a://")) else None
        hint = f"pip install 'datacat[{extra}]'" if extra else f"install the fsspec backend for it ({exc})"
        raise BackendUnavailable(f"reading {url} needs {exc.name or 'its fsspec backend'}: {hint}") from None


def _make(url: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    """A new client for ``url``, or a ShardError once the connect deadline passes."""
    import fsspec

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
        return making.result(timeout=connect_timeout())
    except concurrent.futures.TimeoutError:
        raise ShardError(
            f"cannot connect to {url}: the storage client was not ready within {connect_timeout():.0f} s "
            "(looking for credentials, or the network is down). Check the network and the credentials in "
            "storage_options (DATACAT_CONNECT_TIMEOUT sets the deadline)",
            url=url,
        ) from None
