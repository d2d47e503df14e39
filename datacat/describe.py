"""What ``datacat describe`` reports: the Plan, the entry's facts, and the on-disk contract.

Plain data only, so the CLI can print it as text or JSON and tests can read
it; nothing here opens a shard.
"""

from __future__ import annotations

from typing import Any

from datacat.catalog import Catalog, load_catalog
from datacat.resolve import Plan, resolve
from datacat.rules import is_glob
from datacat.schema import Entry

__all__ = ["describe", "layout_contract"]


def describe(
    name: str, *, catalog: Catalog | None = None, split: str = "train", root: str | None = None
) -> dict[str, Any]:
    """Everything the catalog and the resolver say about one entry, as JSON-able data.

    Args:
        name: An entry name or alias, in any case.
        catalog: The catalog to look in; default the built-in one plus ``$DATACAT_CATALOG``.
        split: The split to resolve.
        root: Replaces the entry's root, as in :func:`datacat.resolve`.

    Globs are listed only for local roots, so describing a bucket entry needs no network.

    Example:
        >>> datacat.describe("cc3m")["shard_count"]
        49
    """
    catalog = load_catalog() if catalog is None else catalog
    canonical = catalog.canonical(name)
    entry = catalog[canonical]
    probe = resolve(canonical, catalog=catalog, split=split, root=root, list_shards=False)
    local = probe.glob is not None and "://" not in probe.glob
    plan = resolve(canonical, catalog=catalog, split=split, root=root, list_shards=True) if local else probe
    return {
        "name": canonical,
        "aliases": list(entry.aliases),
        "description": entry.description,
        "homepage": entry.homepage,
        "license": entry.license,
        "citation": entry.citation,
        "notes": entry.notes,
        "source": catalog.sources[canonical].file,
        "line": catalog.sources[canonical].line,
        "overrides": list(catalog.sources[canonical].overrides),
        "pattern": _pattern(entry),
        "shard_count": len(plan.shards) if plan.glob is None else None,
        "declared": entry.totals.model_dump(mode="json", exclude_none=True),
        "splits": {
            split_name: {"pattern": _pattern_of(where.shards), "samples": where.samples}
            for split_name, where in entry.splits.items()
        },
        "contract": layout_contract(plan, entry),
        "fingerprint": plan.fingerprint(),
        "plan": plan.to_json(),
    }


def _pattern(entry: Entry) -> Any:
    return None if entry.location is None else _pattern_of(entry.location.shards)


def _pattern_of(shards: str | tuple[str, ...]) -> Any:
    return list(shards) if isinstance(shards, tuple) else shards


def layout_contract(plan: Plan, entry: Entry | None = None) -> list[str]:
    """The rules files must follow for this entry to load, one sentence each."""
    record = plan.record
    where = plan.glob or (plan.root + "/<shard>")
    if plan.format == "mixture":
        return [f"Each component ({', '.join(c.plan.name for c in plan.components)}) follows its own contract."]
    lines = []
    if entry is not None and entry.location is not None and not is_glob(entry.location.shards):
        lines.append(f"Every shard the pattern names, except the missing ones, exists under {plan.root}.")
    else:
        lines.append(f"Shards are every file matching {where}, read in sorted order.")
    if plan.format in ("webdataset",):
        lines += [
            "Each shard is a tar file, plain or gzip-compressed (detected from its bytes).",
            "Members of one sample are adjacent and share a key: the path up to the first dot of the file name.",
            f"The image is the member with extension .{record.image}"
            + (f", the caption .{record.caption} (utf-8)" if record.caption else "")
            + (f", the label .{record.label} (an integer)" if record.label else "")
            + ".",
        ]
    elif plan.format == "array_record":
        lines.append("Each shard is an ArrayRecord file; a record is one sample.")
        if record.layout == "packed":
            lines.append(
                "A record is a packed dict: for each entry a little-endian uint32 key length, the utf-8 key, "
                f"a uint32 value length and the value; key {record.image!r} holds the encoded image"
                + (f", {record.caption!r} the utf-8 caption" if record.caption else "")
                + (f", {record.key!r} the sample id" if record.key else "")
                + "."
            )
        elif record.layout == "pre_resized":
            lines.append(
                "A record is a packed dict with 'image' (raw uint8 HxWx3), 'shape' (two little-endian int32: H, W), "
                "'caption' (utf-8) and optionally 'label'."
            )
        elif record.layout == "tf_example":
            lines.append(
                "A record is a serialized tf.train.Example, as `tfds build --file_format=array_record` writes it: "
                f"feature {record.image if record.image != 'jpg' else 'image'!r} the encoded image, {(record.label or 'label')!r} the label, "
                f"{(record.key or 'file_name')!r} the key"
                + (f", {record.caption!r} the caption" if record.caption else "")
                + "."
            )
            lines.append(
                "Without totals.per_shard, the shard lengths come from dataset_info.json beside the shards; "
                "class names from loading.captions.class_names, else label.labels.txt beside the shards."
            )
        else:
            lines.append("A record is one encoded image, with no caption.")
    elif plan.format == "embeddings" and plan.embeddings is not None:
        emb = plan.embeddings
        lines += [
            f"Shard N of {emb.images or 'the image entry'} has a file {emb.prefix}"
            f"{'N'.zfill(emb.shard_width)}.npy of shape [records, {emb.dim}], dtype {emb.dtype}.",
            f"A record key's first {emb.shard_width} digits are its shard number and the rest its row in that file.",
        ]
    elif plan.format == "image_folder":
        lines.append(
            "Images (.jpg, .jpeg, .png, .webp) anywhere under the folder; a caption in a .txt file beside each."
        )
    elif plan.format == "embedding_table" and plan.prior is not None:
        prior = plan.prior
        lines.append(
            f"Shard N is img_emb/img_emb_N.npy, a plain (never pickled) {prior.dtype} array [rows, {prior.dim}]"
            + (", text_emb/text_emb_N.npy of the same shape" if prior.text else "")
            + (", and metadata/metadata_N.parquet with a caption column" if prior.captions else "")
            + ": row-aligned, as clip-retrieval writes them. A row whose image embedding is all zeros is a bad sample."
        )
        if prior.validation_rows is not None:
            lo, hi = prior.validation_rows
            lines.append(f"Global rows [{lo:,}, {hi:,}) are the validation split; training reads every other row.")
    elif plan.format == "huggingface":
        column = record.image if record.image not in (None, "jpg") else "image"
        text = f"column {record.caption!r}" if record.caption not in (None, "txt") else "column 'caption' or 'text'"
        lines.append(
            "The location is a Hugging Face hub dataset (hf://datasets/owner/name[@revision], path: its config) "
            "or a local folder of parquet files; each shard name is a split, loaded through `datasets` "
            f"(HF_HUB_OFFLINE=1 reads only the local cache). Images from column {column!r}, decoded by datacat"
            + (f"; captions from {text}." if record.caption is not None else "; no captions.")
        )
    elif plan.format == "image_list":
        lines.append(
            f"A CSV, TSV or parquet table with image paths in column {record.image!r}"
            + (f" and captions in {record.caption!r}." if record.caption else ".")
        )
    return lines
