"""How long one read of storage may take: every read datacat makes has this deadline.

``DATACAT_READ_TIMEOUT`` (seconds, default 60) bounds each call to the
storage client (a listing, a batch of byte ranges, one object) including the
client's own retries, and each HTTP request of a streamed read; past it the
read fails with an error naming the URL, never a wait without end. Opening a
loader checks the first shard within ``DATACAT_CONNECT_TIMEOUT`` (default 15 s),
so an unreachable bucket is reported at once.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["connect_timeout", "deadline", "read_timeout"]


def read_timeout() -> float:
    """Seconds one storage call may take (``DATACAT_READ_TIMEOUT``, default 60)."""
    return float(os.environ.get("DATACAT_READ_TIMEOUT", "60"))


def connect_timeout() -> float:
    """Seconds the first read of a loader's storage may take (``DATACAT_CONNECT_TIMEOUT``, default 15)."""
    return float(os.environ.get("DATACAT_CONNECT_TIMEOUT", "15"))


def deadline(fs: Any, seconds: float | None = None) -> dict[str, Any]:
    """The keyword that bounds one call of ``fs``: fsspec's async filesystems (gcsfs) take ``timeout=``."""
    if not getattr(fs, "async_impl", False):
        return {}  # local files: a FIFO or device is refused before it is read, a regular file answers
    return {"timeout": read_timeout() if seconds is None else seconds}
