"""The node-local shard cache: remote shards kept whole on a local disk, under a byte cap, read instead of the bucket.

One folder per host, shared by every loader and worker on it::

    <hash>-<name>        a shard downloaded and checked, read in place of its URL
    <hash>-<name>.ok     its seal: the URL, the md5 checked on download, and the file's (size, mtime, inode) then
    <hash>-<name>.part   a download under way, locked by its downloader, sized to the shard (its reservation)
    .lock                held while space is reserved, files evicted and downloads sealed
    cache.json           the cap the last filler kept to

Readers never download: :func:`served` gives a registered URL's local copy
when the file still matches its seal (one ``stat``), else None and the read
goes to the bucket. A copy that no longer matches (written to since, cut
short) is deleted, and the next filler fetches it again. The loader's main
process fills the cache (:mod:`datacat.storage.shard_fill`); the least
recently read shards are evicted to keep the folder under its cap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import posixpath
import re
import threading
import time
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from datacat.cache import cache_dir
from datacat.errors import OptionError

__all__ = ["CacheUsage", "ShardCache", "parse_bytes", "serve", "served"]

log = logging.getLogger(__name__)
TOUCH_EVERY_S = 10.0
"""A read marks its shard recently used (its atime) at most this often: LRU order without a write per read."""
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(size: int | str) -> int:
    """A byte count from an int or a string such as ``"200GB"``, ``"1.5 TiB"`` or ``"500000000"``."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
        unit = match and _UNITS.get(match.group(2).lower())
        if not match or unit is None:
            raise OptionError(f"{size!r} is not a size; write bytes as a number with a unit, e.g. '200GB' or '1.5TiB'")
        value = int(float(match.group(1)) * unit)
    if value <= 0:
        raise OptionError(f"a shard cache's max_bytes must be positive, not {size!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CacheUsage:
    """What a cache folder holds: sealed shards, downloads under way, and their bytes."""

    folder: str
    shards: int
    shard_bytes: int
    partial: int
    partial_bytes: int
    max_bytes: int | None
    """The cap the last filler kept to (None: never filled)."""


@dataclasses.dataclass(frozen=True)
class ShardCache:
    """A node-local folder that keeps remote shards whole, at most ``max_bytes`` of them, least recently read evicted.

    Give one to ``datacat.open(..., shard_cache=...)``, or set
    ``DATACAT_SHARD_CACHE`` (the folder) and ``DATACAT_SHARD_CACHE_BYTES``
    (the cap, e.g. ``200GB``) for every loader of a remote entry.
    """

    folder: str
    max_bytes: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "folder", os.path.abspath(os.path.expanduser(str(self.folder))))
        object.__setattr__(self, "max_bytes", parse_bytes(self.max_bytes))

    @classmethod
    def from_env(cls) -> ShardCache | None:
        """The cache ``DATACAT_SHARD_CACHE`` and ``DATACAT_SHARD_CACHE_BYTES`` name, or None when the folder is unset."""
        folder = os.environ.get("DATACAT_SHARD_CACHE")
        if not folder:
            return None
        size = os.environ.get("DATACAT_SHARD_CACHE_BYTES")
        if not size:
            raise OptionError(
                "DATACAT_SHARD_CACHE is set but DATACAT_SHARD_CACHE_BYTES is not: set the cap too, e.g. "
                "DATACAT_SHARD_CACHE_BYTES=200GB (a cache never grows past its cap)"
            )
        return cls(folder, parse_bytes(size))

    @staticmethod
    def default_folder() -> str:
        """``$DATACAT_SHARD_CACHE``, else ``shards`` in datacat's cache folder."""
        return os.environ.get("DATACAT_SHARD_CACHE") or str(cache_dir() / "shards")

    def path(self, url: str) -> str:
        """Where ``url``'s copy lives: a hash of the URL (shards of two buckets may share a name), then its name."""
        digest = hashlib.sha256(url.encode()).hexdigest()[:16]
        return os.path.join(self.folder, f"{digest}-{posixpath.basename(url.rstrip('/'))}")

    def local_copy(self, url: str) -> str | None:
        """The path of ``url``'s sealed copy, or None: not cached (yet), or found damaged and deleted."""
        path = self.path(url)
        try:
            info = os.stat(path)
        except OSError:
            return None
        signature = (info.st_size, info.st_mtime_ns, info.st_ino)
        if _CHECKED.get(path) != signature:
            seal = read_seal(path)
            if seal is None or seal.get("url") != url:
                return None  # being sealed, or a leftover the filler replaces
            if seal.get("file") != list(signature):
                self.discard(path, info.st_ino, "it changed after it was downloaded and checked")
                return None
            _CHECKED[path] = signature
        if time.time() - info.st_atime > TOUCH_EVERY_S:
            with contextlib.suppress(OSError):  # recency for the LRU order; mtime kept, so the seal still holds
                os.utime(path, ns=(time.time_ns(), info.st_mtime_ns))
        return path

    def discard(self, path: str, inode: int, why: str) -> None:
        """Deletes the copy at ``path`` (if it is still the file ``inode``) and its seal, saying why."""
        with self.locked():
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
                    log.warning("shard cache: deleted %s: %s; it is read from the bucket and fetched again", path, why)
            with contextlib.suppress(OSError):
                if not os.path.exists(path):
                    os.unlink(path + ".ok")
        _CHECKED.pop(path, None)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The folder's lock, held by one filler on the host at a time (a file lock, and a thread lock within a process)."""
        if getattr(_HOLDING, self.folder, False):  # this thread holds it already
            yield
            return
        os.makedirs(self.folder, exist_ok=True)
        with _LOCKS.thread:
            fd = os.open(os.path.join(self.folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                setattr(_HOLDING, self.folder, True)
                yield
            finally:
                setattr(_HOLDING, self.folder, False)
                fcntl.flock(fd, fcntl.LOCK_UN)  # released now, even where a forked child holds a copy of fd
                os.close(fd)

    def reserve(self, size: int, keep: Collection[str], part: str) -> bool:
        """Room for ``size`` more bytes, made by evicting least recently read copies not in ``keep``; call locked.

        ``part`` is the download asking (its own reservation is not counted
        twice). Downloads whose downloader died are deleted; sealed copies of
        ``keep`` (this plan's shards) are never evicted for one another, so a
        plan larger than the cap settles on a fixed part of it instead of
        churning.
        """
        entries = self._entries()
        used = sum(e.size for e in entries if e.path != part)
        if used + size <= self.max_bytes:
            return True
        for entry in entries:
            if entry.kind == "part" and entry.path != part and not _held(entry.path):
                used -= _unlink(entry.path, entry.size)
        evictable = sorted((e for e in entries if e.kind == "shard" and e.path not in keep), key=lambda e: e.atime)
        for entry in evictable:
            if used + size <= self.max_bytes:
                break
            used -= _unlink(entry.path, entry.size)
            used -= _unlink(entry.path + ".ok", _size(entry.path + ".ok"))
            _CHECKED.pop(entry.path, None)
        return used + size <= self.max_bytes

    def usage(self) -> CacheUsage:
        """What the folder holds now."""
        entries = self._entries()
        shards = [e for e in entries if e.kind == "shard"]
        parts = [e for e in entries if e.kind == "part"]
        try:
            cap = int(json.loads(Path(self.folder, "cache.json").read_text())["max_bytes"])
        except (OSError, ValueError, KeyError, TypeError):
            cap = None
        return CacheUsage(
            self.folder, len(shards), sum(e.size for e in shards), len(parts), sum(e.size for e in parts), cap
        )

    def clear(self) -> tuple[int, int]:
        """Deletes every copy and seal, and every download no process holds; returns (files, bytes) deleted."""
        files = freed = 0
        with self.locked():
            for entry in self._entries():
                if entry.kind == "part" and _held(entry.path):
                    continue
                if os.path.lexists(entry.path):
                    files, freed = files + 1, freed + _unlink(entry.path, entry.size)
        _CHECKED.clear()
        return files, freed

    def note_cap(self) -> None:
        """Records the cap in the folder, for ``datacat cache info``."""
        os.makedirs(self.folder, exist_ok=True)
        path = Path(self.folder, "cache.json")
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({"max_bytes": self.max_bytes}))
        os.replace(tmp, path)

    def _entries(self) -> list[_Entry]:
        out: list[_Entry] = []
        try:
            scan = list(os.scandir(self.folder))
        except FileNotFoundError:
            return out
        for item in scan:
            if item.name.startswith(".") or item.name == "cache.json" or item.name.endswith(".tmp"):
                continue
            try:
                info = item.stat(follow_symlinks=False)
            except OSError:
                continue
            kind = "part" if item.name.endswith(".part") else "seal" if item.name.endswith(".ok") else "shard"
            out.append(_Entry(item.path, kind, info.st_size, info.st_atime))
        return out


@dataclasses.dataclass(frozen=True)
class _Entry:
    path: str
    kind: str
    size: int
    atime: float


def read_seal(path: str) -> dict[str, object] | None:
    """The seal of the copy at ``path``, or None when it has none (or an unreadable one)."""
    try:
        seal = json.loads(Path(path + ".ok").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return seal if isinstance(seal, dict) else None


def _held(path: str) -> bool:
    """Whether a process holds the download lock of ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # a lock it took goes with it
    return False


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _unlink(path: str, size: int) -> int:
    """Deletes ``path``; its ``size`` when it was there, else 0."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return 0
    return size


class _Locks:
    """This process's lock over the cache folders' file locks; a forked child starts with a free one."""

    def __init__(self) -> None:
        self.thread = threading.Lock()

    def after_fork(self) -> None:
        self.thread = threading.Lock()


_LOCKS = _Locks()
os.register_at_fork(after_in_child=_LOCKS.after_fork)
_HOLDING = threading.local()  # folder -> whether this thread holds its lock
_CHECKED: dict[str, tuple[int, int, int]] = {}  # path -> the signature its seal was found to match, this process
_SERVED: dict[str, ShardCache] = {}  # URL -> the cache that may hold it, this process


def serve(cache: ShardCache, urls: Iterable[str]) -> None:
    """Reads of ``urls`` in this process use ``cache``'s copies where they are sealed."""
    for url in urls:
        _SERVED[url] = cache


def served(url: str) -> str | None:
    """The local copy to read instead of ``url``, or None (not registered, not cached, or damaged)."""
    cache = _SERVED.get(url)
    return None if cache is None else cache.local_copy(url)
