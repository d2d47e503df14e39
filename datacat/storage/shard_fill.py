"""Filling the shard cache: a loader's remote shards downloaded once per host, checked, sealed, in a background thread.

The loader's main process runs one :class:`Filler` per loader. It takes the
plan's shards in order; for each not yet cached it reserves the shard's
size under the folder's lock (evicting least recently read copies of other
plans), downloads it into a ``.part`` file that it holds locked (another
process on the host finding the lock held leaves that shard to it and
comes back later), checks size and md5 against the store's metadata and the
manifest, writes the seal and renames the file into place. A shard that
cannot be had (no room, a failed or mismatched download) is read from the
bucket as before: the filler warns and never stops the loader.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from datacat.plan import Plan
from datacat.storage.files import object_info, read_ranges
from datacat.storage.manifests import load_manifest
from datacat.storage.shard_cache import ShardCache

__all__ = ["CHUNK", "Filler", "Wanted", "md5_hex", "wanted_shards"]

log = logging.getLogger(__name__)
CHUNK = 8 * 2**20
"""A download is read in ranges of this size, ``IN_FLIGHT`` at once."""
IN_FLIGHT = 4


@dataclasses.dataclass(frozen=True)
class Wanted:
    """One shard to cache: its URL, storage options, and the manifest's bytes and checksum where known."""

    url: str
    storage_options: Mapping[str, Any]
    size: int | None = None
    checksum: str | None = None


def wanted_shards(plan: Plan) -> list[Wanted]:
    """The shards of ``plan`` (a mixture's components taken in turn), with what its manifest knows of each."""
    if plan.components:
        parts = [wanted_shards(c.plan) for c in plan.components]
        return [w for group in _in_turn(parts) for w in group]
    facts = load_manifest(plan.manifest) if plan.manifest else None
    known = facts.shards if facts else {}
    out = []
    for shard in plan.shards:
        fact = known.get(shard.name)
        size, checksum = (fact.bytes, fact.checksum) if fact is not None else (None, None)
        out.append(Wanted(shard.url, plan.storage_options, size, checksum))
    return out


def _in_turn(groups: Sequence[Sequence[Wanted]]) -> list[list[Wanted]]:
    """Rows of ``groups`` taken one from each in turn (shorter groups drop out)."""
    rows: list[list[Wanted]] = []
    for i in range(max((len(g) for g in groups), default=0)):
        rows.append([g[i] for g in groups if i < len(g)])
    return rows


def md5_hex(checksum: str | None) -> str | None:
    """The md5 (hex) a store or manifest checksum states: ``md5:<hex>``, GCS's base64 ``md5Hash``, an S3 ETag; else None."""
    if not checksum:
        return None
    text = checksum.strip().strip('"')
    if text.startswith("md5:"):
        return text[4:].lower()
    if re.fullmatch(r"[0-9a-fA-F]{32}", text):
        return text.lower()  # an S3 ETag of a single-part upload (a multipart one has a '-')
    with contextlib.suppress(binascii.Error, ValueError):
        raw = base64.b64decode(text, validate=True)
        if len(raw) == 16:
            return raw.hex()
    return None  # crc32c, a multipart ETag: the size is checked alone


class Filler:
    """Downloads ``wanted`` into ``cache`` in a daemon thread; :meth:`stop` ends it between chunks."""

    def __init__(self, cache: ShardCache, wanted: Sequence[Wanted], *, name: str) -> None:
        self.cache, self.wanted, self.name = cache, list(wanted), name
        self.keep = frozenset(cache.path(w.url) for w in self.wanted)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"datacat-shard-cache-{name}", daemon=True)
        self.cached = 0
        self.downloaded = 0

    def start(self) -> Filler:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.cache.note_cap()
            pending = self.wanted
            while pending and not self._stop.is_set():
                busy: list[Wanted] = []
                for wanted in pending:
                    if self._stop.is_set():
                        return
                    outcome = self._fill(wanted)
                    if outcome == "full":
                        log.warning(
                            "%s: shard cache %s is full at its cap (%d bytes): %d of %d shards cached, the rest "
                            "are read from the bucket. Raise max_bytes to cache them all",
                            self.name,
                            self.cache.folder,
                            self.cache.max_bytes,
                            self.cached,
                            len(self.wanted),
                        )
                        return
                    if outcome == "busy":
                        busy.append(wanted)
                    elif outcome == "cached":
                        self.cached += 1
                pending = busy
                if pending:
                    self._stop.wait(0.5)  # another process on this host is downloading them
        except Exception as exc:  # the loader reads from the bucket as before
            log.warning("%s: shard cache %s stopped filling: %s", self.name, self.cache.folder, exc)

    def _fill(self, wanted: Wanted) -> str:
        """``cached``, ``busy`` (another process downloads it), ``full`` or ``failed``."""
        cache, url = self.cache, wanted.url
        if cache.local_copy(url) is not None:
            return "cached"
        final = cache.path(url)
        part = final + ".part"
        os.makedirs(cache.folder, exist_ok=True)
        fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return "busy"  # another process on this host downloads it
        try:
            same = os.fstat(fd).st_ino == os.stat(part).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # its downloader finished or gave up between our open and our lock
            self._release(fd)
            return "busy"
        if cache.local_copy(url) is not None:  # sealed just before: our open made a new, empty part
            self._drop(fd, part)
            return "cached"
        try:
            info = object_info(url, wanted.storage_options)
        except Exception as exc:
            self._drop(fd, part)
            log.warning("%s: not caching %s: %s", self.name, url, exc)
            return "failed"
        size = int(info["size"])
        store_md5 = md5_hex(info.get("md5Hash") or info.get("ETag") or info.get("etag"))
        if wanted.size is not None and wanted.size != size:
            self._drop(fd, part)
            log.warning(
                "%s: not caching %s: the bucket holds %d bytes, the manifest %d (changed since it was verified? "
                "run `datacat verify %s`)",
                self.name,
                url,
                size,
                wanted.size,
                self.name,
            )
            return "failed"
        with cache.locked():
            if not cache.reserve(size, self.keep, part):
                self._drop(fd, part)
                return "full"
            os.ftruncate(fd, size)  # the reservation, seen by every other filler's count
        try:
            digest = self._download(fd, url, size, wanted.storage_options)
        except Exception as exc:
            self._drop(fd, part)
            if not self._stop.is_set():
                log.warning("%s: not caching %s: %s", self.name, url, exc)
            return "failed"
        expected = [m for m in (store_md5, md5_hex(wanted.checksum)) if m]
        if any(m != digest for m in expected):
            self._drop(fd, part)
            log.warning("%s: not caching %s: its download's md5 %s is not %s", self.name, url, digest, expected[0])
            return "failed"
        os.fdatasync(fd)
        info_now = os.fstat(fd)
        seal = {"url": url, "md5": digest, "file": [info_now.st_size, info_now.st_mtime_ns, info_now.st_ino]}
        with cache.locked():
            tmp = f"{final}.ok.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(seal, f)
            os.replace(tmp, final + ".ok")
            os.replace(part, final)
        self._release(fd)
        self.downloaded += 1
        return "cached"

    def _download(self, fd: int, url: str, size: int, storage_options: Mapping[str, Any]) -> str:
        md5 = hashlib.md5(usedforsecurity=False)
        starts = list(range(0, size, CHUNK))
        for i in range(0, len(starts), IN_FLIGHT):
            if self._stop.is_set():
                raise InterruptedError("the loader closed")
            group = [(url, s, min(s + CHUNK, size)) for s in starts[i : i + IN_FLIGHT]]
            for (_, start, _), data in zip(group, read_ranges(group, storage_options), strict=True):
                if isinstance(data, Exception):
                    raise data
                os.pwrite(fd, data, start)
                md5.update(data)
        return md5.hexdigest()

    @staticmethod
    def _drop(fd: int, part: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(part)
        Filler._release(fd)

    @staticmethod
    def _release(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
