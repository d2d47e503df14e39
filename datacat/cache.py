"""The user cache folder, where datacat keeps what it learns of shard sets and catalog files."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The folder datacat caches manifests and tar indexes in.

    ``$DATACAT_CACHE``, else ``$XDG_CACHE_HOME/datacat``, else ``~/.cache/datacat``.
    """
    if env := os.environ.get("DATACAT_CACHE"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "datacat"
