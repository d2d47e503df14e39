"""Hugging Face datasets read by index through the ``datasets`` library (the ``datacat[hf]`` extra).

An entry's location names the dataset and its shards name splits:

    location: {root: "hf://datasets/owner/name@revision", path: config, shards: [train]}
    location: {root: ./my-parquet-folder, shards: [train]}

``hf://datasets/...`` is a hub id (``@revision`` and ``path`` as the config
name are optional); anything else is a local folder of parquet files,
relative to the catalog file, laid out as ``datasets`` expects
(``train-*.parquet`` or ``data/train-*.parquet``). Each split is loaded
with ``datasets.load_dataset`` into its memory-mapped Arrow cache; the image
column is read undecoded (``Image(decode=False)``) and decoded by datacat's
own transform, like every other format's images, so the pixels are the
same as from a tar or an ArrayRecord of the same JPEG. With
``HF_HUB_OFFLINE=1`` only the local cache is read; a dataset not cached there
is an error that says what to run.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from datacat.errors import ShardError
from datacat.formats import RawItem, check_declared, record_caption
from datacat.registry import Format
from datacat.storage import read_bytes

if TYPE_CHECKING:
    from datacat.plan import Plan

__all__ = ["FORMAT", "HuggingFaceReader", "hub_id"]

HUB = "hf://datasets/"


def hub_id(root: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, revision, config) of an ``hf://datasets/owner/name[@rev][/config]`` root; None for a local folder."""
    if not root.startswith(HUB):
        return None
    parts = root[len(HUB) :].strip("/").split("/")
    if len(parts) < 2:
        raise ValueError(f"{root!r} names no dataset: write hf://datasets/owner/name")
    name, _, revision = parts[1].partition("@")
    config = "/".join(parts[2:]) or None
    return f"{parts[0]}/{name}", revision or None, config


class HuggingFaceReader:
    """Rows of one or more splits of a Hugging Face dataset, by global index, splits in plan order."""

    random_access: Literal[True] = True

    def __init__(self, plan: Plan) -> None:
        self.name = plan.name
        self.record = plan.record
        self.root = plan.root
        self.image_column = plan.record.image if plan.record.image not in (None, "jpg") else "image"
        self.splits = tuple(s.name for s in plan.shards)
        self.parts = [_load(plan.root, split, self.image_column) for split in self.splits]
        self.counts = tuple(len(p) for p in self.parts)  # rows per split: what `datacat count` prints
        check_declared(  # a split whose count moved since: pin the revision (root@...) the counts came from
            [s.url for s in plan.shards],
            [s.samples for s in plan.shards],
            self.counts,
            kind="split ",
            holds="has {} rows",
        )
        self.offsets = tuple(itertools.accumulate(self.counts, initial=0))

    def __repr__(self) -> str:
        return f"HuggingFaceReader({self.name!r}, splits={list(self.splits)}, rows={len(self)})"

    def __len__(self) -> int:
        return self.offsets[-1]

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]:
        """The rows at global ``indices``, each split's rows fetched in one call."""
        where = []
        for index in indices:
            if not 0 <= index < len(self):
                raise IndexError(f"row {index} is outside 0..{len(self) - 1} of {self.name}")
            part = bisect.bisect_right(self.offsets, index) - 1
            where.append((part, index - self.offsets[part]))
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        for part in {p for p, _ in where}:
            positions = sorted({r for p, r in where if p == part})
            for position, row in zip(positions, self.parts[part].__getitems__(positions), strict=True):
                rows[(part, position)] = row
        return [
            RawItem(
                f"{self.splits[part]}:{position}", f"{self.root}/{self.splits[part]}", index, rows[(part, position)]
            )
            for index, (part, position) in zip(indices, where, strict=True)
        ]

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one row: its undecoded image, caption (``caption`` or ``text`` unless named), label, key."""
        row, record = item.payload, self.record
        out: dict[str, Any] = {"__key__": item.key, "__shard__": item.shard, "__uid__": item.uid}
        image = row.get(self.image_column)
        if isinstance(image, dict):  # datasets' Image(decode=False): {"bytes": ..., "path": ...}
            data, path = image.get("bytes"), image.get("path")
            out["image"] = data if data else (read_bytes(path) if path else None)
        else:
            out["image"] = image
        keys = (record.caption,) if record.caption not in (None, "txt") else ("caption", "text")
        if record.caption is not None:
            # Several captions per image (flickr30k's five): the first, as the dataset lists them.
            row = {k: (v[0] if v else None) if isinstance(v, list) else v for k, v in row.items() if k in keys}
            out["caption"] = record_caption(row, keys)
        else:
            out["caption"] = None
        if record.label and row.get(record.label) is not None:
            out["label"] = int(row[record.label])
        if record.key and row.get(record.key) is not None:
            out["__key__"] = str(row[record.key])
        return out


def _load(root: str, split: str, image_column: str) -> Any:
    import datasets  # the hf extra; only Hugging Face entries import it

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    hub = hub_id(root)
    try:
        if hub is None:
            if not os.path.isdir(root):
                raise FileNotFoundError(2, f"{root} is not a folder of parquet files; check the entry's root", root)
            part = datasets.load_dataset(root, split=split)
        else:
            repo, revision, config = hub
            part = datasets.load_dataset(repo, config, revision=revision, split=split)
    except (FileNotFoundError, ShardError):
        raise
    except (ValueError, KeyError) as exc:  # an unknown split, a config the dataset lacks
        raise ShardError(f"{root}: {exc}", url=f"{root}/{split}") from None
    except Exception as exc:  # datasets and huggingface_hub raise many classes for "not there, and offline"
        if hub is not None and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
            repo, revision, config = hub
            args = ", ".join(
                [repr(repo), *([repr(config)] if config else []), f"split={split!r}"]
                + ([f"revision={revision!r}"] if revision else [])
            )
            raise ShardError(
                f"{repo} (split {split}) is not in the local Hugging Face cache and HF_HUB_OFFLINE=1: run "
                f'`python -c "import datasets; datasets.load_dataset({args})"` once with network, or set '
                f"HF_HUB_OFFLINE=0 ({type(exc).__name__}: {exc})",
                url=f"{root}/{split}",
            ) from None
        raise ShardError(
            f"cannot load {root} split {split}: {type(exc).__name__}: {exc}", url=f"{root}/{split}"
        ) from None
    if image_column not in part.column_names:
        raise ShardError(
            f"{root} split {split} has no image column {image_column!r} (its columns: {part.column_names}); "
            "set record.image",
            url=f"{root}/{split}",
        )
    if isinstance(part.features[image_column], datasets.Image):
        part = part.cast_column(image_column, datasets.Image(decode=False))
    return part


def _contract(plan: Plan) -> list[str]:
    record = plan.record
    column = record.image if record.image not in (None, "jpg") else "image"
    text = f"column {record.caption!r}" if record.caption not in (None, "txt") else "column 'caption' or 'text'"
    return [
        "The location is a Hugging Face hub dataset (hf://datasets/owner/name[@revision], path: its config) "
        "or a local folder of parquet files; each shard name is a split, loaded through `datasets` "
        f"(HF_HUB_OFFLINE=1 reads only the local cache). Images from column {column!r}, decoded by datacat"
        + (f"; captions from {text}." if record.caption is not None else "; no captions.")
    ]


FORMAT = Format(
    HuggingFaceReader,
    "random",
    ("rows",),
    _contract,
    hint="Hugging Face datasets need the datasets library: pip install 'datacat[hf]'",
)
