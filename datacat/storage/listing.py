"""Listing the shards a glob matches, in a stable order, under the read deadline."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any

from datacat.errors import ShardError
from datacat.limits import deadline
from datacat.plan import Shard
from datacat.redact import remember
from datacat.storage.clients import filesystem
from datacat.storage.errors import raise_mapped
from datacat.storage.retry import with_retries

__all__ = ["list_glob"]

_GLOB_CHARS = frozenset("*?[")  # what makes a shard spec a glob (as datacat.rules.is_glob reads it)


def list_glob(glob: str, storage_options: Mapping[str, Any]) -> list[Shard]:
    """The shards ``glob`` matches, sorted by URL; none matching, or storage failing, is a ShardError naming it."""
    remember(storage_options)
    try:
        fs, path = filesystem(glob, storage_options)
        found = sorted(with_retries(lambda: fs.glob(path, **deadline(fs)), glob))
    except (ShardError, FileNotFoundError) as exc:
        # The cause says what to check; a wrong root is fixed by DATACAT_ROOT or root=.
        error = ShardError(f"cannot list shards {glob} (or set DATACAT_ROOT, or root=): {exc}", url=glob)
        raise_mapped(error, exc)
    if not found:
        raise ShardError(f"no shards match {glob}; check the entry's root and path", url=glob)
    folder = posixpath.dirname(glob) if "://" in glob else os.path.dirname(glob)
    shards = []
    for item in found:
        name = posixpath.basename(item)
        # Keep the URL as the catalog spells it when the glob is in the file name only.
        if _GLOB_CHARS.isdisjoint(folder):
            url = f"{folder.rstrip('/')}/{name}" if "://" in folder else os.path.join(folder, name)
        else:
            url = fs.unstrip_protocol(item)
        shards.append(Shard(name=name, url=url))
    return shards
