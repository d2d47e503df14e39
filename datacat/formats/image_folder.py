"""Folders of image files, each optionally captioned by a ``.txt`` file beside it."""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from datacat.errors import ShardError
from datacat.formats import RawItem, record_caption
from datacat.limits import deadline
from datacat.registry import Format
from datacat.storage import filesystem, read_many, with_retries

if TYPE_CHECKING:
    from datacat.plan import Plan

__all__ = ["FORMAT", "IMAGE_SUFFIXES", "ImageFolderReader"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


class ImageFolderReader:
    """Images under each shard folder (recursively, sorted), by global index."""

    random_access: Literal[True] = True

    def __init__(self, plan: Plan) -> None:
        self.name = plan.name
        self.storage_options = dict(plan.storage_options)
        self.files: list[tuple[str, str]] = []  # (folder url, image url)
        captions: set[str] = set()
        counts = []
        for shard in plan.shards:
            fs, root = filesystem(shard.url, self.storage_options)
            if not with_retries(lambda: fs.isdir(root, **deadline(fs)), shard.url):  # noqa: B023 (called at once)
                raise ShardError(f"image folder {shard.url} does not exist or is not a folder", url=shard.url)
            prefix, root = shard.url.rstrip("/"), root.rstrip("/")
            before = len(self.files)
            for path in sorted(with_retries(lambda: fs.find(root, **deadline(fs)), shard.url)):  # noqa: B023
                url = prefix + "/" + posixpath.relpath(path, root)
                if path.lower().endswith(IMAGE_SUFFIXES):
                    self.files.append((shard.url, url))
                elif path.endswith(".txt"):
                    captions.add(url)
            counts.append(len(self.files) - before)
        self.caption_files = frozenset(captions)
        self.counts = tuple(counts)

    def __repr__(self) -> str:
        return f"ImageFolderReader({self.name!r}, images={len(self.files)})"

    def __len__(self) -> int:
        return len(self.files)

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]:
        """The images at ``indices`` with their caption files, all fetched concurrently."""
        urls = [self.files[i][1] for i in indices]
        captions = [posixpath.splitext(u)[0] + ".txt" for u in urls]
        wanted = [c for c in captions if c in self.caption_files]
        fetched = read_many(urls + wanted, self.storage_options)
        texts = dict(zip(wanted, fetched[len(urls) :], strict=True))
        out: list[RawItem | Exception] = []
        for index, url, data, caption_url in zip(indices, urls, fetched[: len(urls)], captions, strict=True):
            text = texts.get(caption_url)
            problem = data if isinstance(data, Exception) else text if isinstance(text, Exception) else None
            if problem is not None:
                out.append(problem)
                continue
            folder = self.files[index][0]
            key = posixpath.splitext(posixpath.relpath(url, folder.rstrip("/")))[0]
            out.append(RawItem(key, folder, index, (data, text)))
        return out

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one image file: its bytes and the caption file beside it, if any."""
        image, text = item.payload
        caption = None if text is None else record_caption({"txt": text}, ("txt",))
        return {"__key__": item.key, "__shard__": item.shard, "__uid__": item.uid, "image": image, "caption": caption}


_FILE_SUFFIXES = (*IMAGE_SUFFIXES, ".tar", ".csv", ".tsv", ".parquet", ".array_record", ".npy")


def _names_a_folder(shard: str) -> bool:
    return not shard.lower().endswith(_FILE_SUFFIXES)


def _contract(plan: Plan) -> list[str]:
    return ["Images (.jpg, .jpeg, .png, .webp) anywhere under the folder; a caption in a .txt file beside each."]


FORMAT = Format(
    ImageFolderReader,
    "random",
    ("files",),
    _contract,
    names_a_shard=_names_a_folder,
    shards_are='its shards are folders of images, e.g. shards: [train] or "{00..09}" (every image under each, '
    "recursively, with a .txt caption beside it)",
    counted="at_open",
)
