"""What is known of a shard set after reading it once: names, records and bytes per shard, tar member spans.

A manifest is a JSON file in the user cache dir (:func:`datacat.cache.cache_dir`),
keyed by the shard set it describes (:func:`datacat.plan.manifest_key`: format,
base URL, shard pattern, missing shards), not by how it is loaded.
``datacat verify`` writes one; opening an entry writes
the counts and tar spans it had to compute; ``describe``, ``count`` and
``open`` use it, so a glob entry need not be listed and a tar need not be
indexed again. Point ``DATACAT_CACHE`` at a shared folder to index once for
many hosts. Plain data only: no numpy here (the core install has none).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from datacat.cache import cache_dir

__all__ = ["Manifest", "ShardFacts", "load_manifest", "save_index", "save_manifest"]

VERSION = 1


@dataclasses.dataclass
class ShardFacts:
    """One shard as last read: its records and bytes, a checksum if verified, its tar index file if any."""

    name: str
    records: int
    url: str = ""
    bytes: int | None = None
    checksum: str | None = None
    index: str | None = None
    """File name (under the cache dir's ``tar-index``) of the shard's sample spans, int64 [records, 2]."""
    compressed: bool = False


@dataclasses.dataclass
class Manifest:
    """The facts of one shard set, by shard name, in shard order."""

    key: str
    entry: str
    base: str
    shards: dict[str, ShardFacts]
    verified: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "key": self.key,
            "entry": self.entry,
            "base": self.base,
            "verified": self.verified,
            "shards": [dataclasses.asdict(f) for f in self.shards.values()],
        }


def _path(key: str) -> Path:
    return cache_dir() / "manifests" / f"{key}.json"


def load_manifest(key: str) -> Manifest | None:
    """The manifest stored under ``key``, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(_path(key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION or data.get("key") != key:
        return None
    try:
        shards = {s["name"]: ShardFacts(**s) for s in data["shards"]}
    except (KeyError, TypeError):
        return None
    return Manifest(key, str(data["entry"]), str(data["base"]), shards, bool(data.get("verified")))


def save_manifest(manifest: Manifest) -> Path:
    """Writes ``manifest`` atomically (a reader never sees half a file) and returns its path."""
    path = _path(manifest.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(manifest.to_json(), f)
    os.replace(tmp, path)
    return path


def save_index(kind: str, array: Any, url: str) -> str:
    """Writes a shard's index (a numpy array) under the cache's ``kind`` folder, once; returns its file name.

    The name is a hash of the index and the shard's URL, so concurrent
    writers of the same index write the same file (atomically, by rename).
    """
    import numpy as np  # only the readers that index shards have numpy

    digest = hashlib.sha256(array.tobytes() + url.encode()).hexdigest()[:24]
    folder = cache_dir() / kind
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.npy"
    if not path.is_file():
        tmp = folder / f".tmp-{digest}-{os.getpid()}-{threading.get_ident()}.npy"
        np.save(tmp, array)
        os.replace(tmp, path)
    return path.name
