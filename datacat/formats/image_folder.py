"""Folders of image files, each optionally captioned by a ``.txt`` file beside it."""

from __future__ import annotations

import posixpath
from typing import Any

import fsspec

from datacat.errors import ShardError
from datacat.formats import RawItem, record_caption
from datacat.formats.storage import read_bytes
from datacat.resolve import Plan

__all__ = ["IMAGE_SUFFIXES", "ImageFolderReader"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


class ImageFolderReader:
    """Images under each shard folder (recursively, sorted), by global index."""

    def __init__(self, plan: Plan) -> None:
        self.name = plan.name
        self.storage_options = dict(plan.storage_options)
        self.files: list[tuple[str, str]] = []  # (folder url, image url)
        captions: set[str] = set()
        for shard in plan.shards:
            fs, root = fsspec.core.url_to_fs(shard.url, **self.storage_options)
            if not fs.isdir(root):
                raise ShardError(f"image folder {shard.url} does not exist or is not a folder")
            prefix, root = shard.url.rstrip("/"), root.rstrip("/")
            for path in sorted(fs.find(root)):
                url = prefix + "/" + posixpath.relpath(path, root)
                if path.lower().endswith(IMAGE_SUFFIXES):
                    self.files.append((shard.url, url))
                elif path.endswith(".txt"):
                    captions.add(url)
        self.caption_files = frozenset(captions)

    def __repr__(self) -> str:
        return f"ImageFolderReader({self.name!r}, images={len(self.files)})"

    def __len__(self) -> int:
        return len(self.files)

    def item(self, index: int) -> RawItem:
        """The path of image ``index``; bytes are read when parsed."""
        folder, url = self.files[index]
        key = posixpath.splitext(posixpath.relpath(url, folder.rstrip("/")))[0]
        return RawItem(key, folder, index, url)

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one image file: its bytes and the caption file beside it, if any."""
        url: str = item.payload
        caption_url = posixpath.splitext(url)[0] + ".txt"
        caption = None
        if caption_url in self.caption_files:
            caption = record_caption({caption_url: read_bytes(caption_url, self.storage_options)}, (caption_url,))
        return {
            "__key__": item.key,
            "__shard__": item.shard,
            "__uid__": item.uid,
            "image": read_bytes(url, self.storage_options),
            "caption": caption,
        }
