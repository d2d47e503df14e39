"""Opening shard URLs through fsspec, with storage errors translated once, here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

import fsspec

from datacat.errors import ShardError

__all__ = ["open_url", "read_bytes"]


def open_url(url: str, storage_options: Mapping[str, Any] | None = None) -> IO[bytes]:
    """``url`` opened for binary reading; a missing file is ``FileNotFoundError(url)``."""
    try:
        return fsspec.open(url, "rb", **dict(storage_options or {})).open()  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise FileNotFoundError(2, f"shard not found: {url}; check the entry's root or its missing list", url) from None
    except (OSError, ValueError) as exc:
        raise ShardError(f"cannot open {url}: {exc}") from exc


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole content of ``url``."""
    with open_url(url, storage_options) as f:
        return f.read()
