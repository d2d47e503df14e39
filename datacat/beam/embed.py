"""``datacat embed``: a user function over every record, written as embedding files aligned with the shards.

The function is ``fn(images, captions) -> {"image": [B, D], "text": [B, D]?}``
with ``images`` uint8 ``[B, H, W, 3]`` at the entry's image size (no
augmentation) and ``captions`` a list of B strings. A batch holds rows of
one shard; the function is imported once per worker (``setup``). Its
error is a FunctionError naming it and the first record it fails on.

The output is DALLE2-pytorch's layout, aligned with the entry's shards:
shard ``NNNN`` (the tar's number, or the shard's place for other formats)
gives ``img_emb/img_emb_NNNN.npy`` (row = the record's index in its shard),
``text_emb/text_emb_NNNN.npy`` when the function returns text embeddings,
and ``metadata/metadata_NNNN.parquet`` (key, caption). A record that cannot
be read or decoded gets a zero row and a line in ``ledger.jsonl``, never a
shifted row. ``catalog.yaml`` beside them holds an ``embedding_table``
entry (the diffusion prior's) and, for a webdataset entry, an ``embeddings``
entry that joins each tar sample with its row.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import itertools
import json
import os
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import apache_beam as beam
import numpy as np
import yaml

from datacat.beam import clear_scratch, commit, counter, local_catalog, part_of, run, text_file, whole_epoch
from datacat.catalog import Catalog, builtin_catalog_dir, load_catalog
from datacat.errors import FunctionError, OptionError
from datacat.plan import Plan
from datacat.planning import resolve
from datacat.redact import redact
from datacat.storage import filesystem, is_remote, read_bytes
from datacat.transforms.ledger import Ledger

__all__ = ["Embedding", "embed", "load_function"]

EmbedFn = Callable[[np.ndarray, list[str]], dict[str, Any]]


def load_function(target: str) -> EmbedFn:
    """The function ``module:name`` names, imported now; a clear error when it is not there."""
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise OptionError(f"--fn {target!r}: write module:function, e.g. my_encoders:clip_l14")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise OptionError(f"--fn {target!r}: cannot import {module_name} ({exc}); is it on PYTHONPATH?") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise OptionError(f"--fn {target!r}: {module_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


@dataclasses.dataclass(frozen=True)
class Embedding:
    """What an ``embed`` job makes: the function, where, and each shard's file number and records."""

    plan: Plan
    out: str
    fn: str
    batch_size: int
    numbers: tuple[str, ...]
    """Each shard's file number (``0003``), in plan order."""
    offsets: tuple[int, ...]
    """Each shard's first record position, then the total."""
    image_dim: int
    text_dim: int | None
    source_entry: dict[str, Any] | None = None
    """The embedded entry as the written catalog repeats it (roots absolute), when the built-in catalog lacks it."""

    def file(self, kind: str, shard: int, suffix: str = ".npy") -> str:
        return f"{self.out}/{kind}/{kind}_{self.numbers[shard]}{suffix}"


def _numbers(plan: Plan) -> tuple[str, ...]:
    # A tar's own number (img2dataset names shards 00000.tar and keys 00000xxxx): what the embeddings
    # format pairs files and keys by. Other formats: the shard's place, four digits.
    if plan.format == "webdataset":
        found = [re.match(r"\d+", posixpath.basename(s.name)) for s in plan.shards]
        if all(found):
            return tuple(m.group() for m in found if m)
    return tuple(f"{i:04d}" for i in range(len(plan.shards)))


Row = tuple[int, int, str, str, Any]
"""(shard, row in shard, key, caption, image uint8 HxWx3 or the reason it could not be read)."""


class _ReadShard(beam.DoFn):  # type: ignore[misc]
    """Every record of one shard, decoded at the entry's size, or the reason it could not be, in batches.

    A batch is up to ``batch_size`` rows of one shard, made here rather
    than by ``beam.BatchElements``, which emits nothing on the DaskRunner.
    """

    def __init__(self, job: Embedding) -> None:
        self.job = job
        self.read, self.bad = counter("records_read"), counter("records_bad")

    def process(self, shard: int) -> Iterator[list[Row]]:
        batch: list[Row] = []
        for row in self._rows(shard):
            batch.append(row)
            if len(batch) == self.job.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def _rows(self, shard: int) -> Iterator[Row]:
        counts = [b - a for a, b in itertools.pairwise(self.job.offsets)]
        # This shard alone: a worker indexes no tar that another unit reads.
        _, view = whole_epoch(part_of(self.job.plan, shard, shard + 1, counts))
        ledger = Ledger(self.job.plan.name, policy="skip", budget=1.0)
        for start in range(0, counts[shard], 64):
            rows = range(start, min(counts[shard], start + 64))
            for row, output in zip(rows, view.finish(view.fetch(rows)), strict=True):
                sample = ledger.admit(output)  # a shard that cannot be read raises: the runner retries the bundle
                self.read.inc()
                if sample is None:
                    bad = ledger.skipped[-1]
                    self.bad.inc()
                    yield shard, row, bad.key, "", bad.reason
                else:
                    yield shard, row, sample["key"], sample.get("caption") or "", sample["image"]


class _Embed(beam.DoFn):  # type: ignore[misc]
    """The user function over one batch of rows; unreadable rows pass through without a vector."""

    def __init__(self, job: Embedding) -> None:
        self.job = job
        self.embedded = counter("records_embedded")

    def setup(self) -> None:
        self.fn = load_function(self.job.fn)

    def process(self, batch: list[Row]) -> Iterator[tuple[int, tuple[int, str, str, Any, Any, str]]]:
        good = [i for i, r in enumerate(batch) if not isinstance(r[4], str)]  # a str is why it could not be read
        vectors: dict[str, np.ndarray] = {}
        if good:
            result = self._call([batch[i] for i in good])
            vectors = {k: np.asarray(v, dtype=np.float32) for k, v in result.items() if v is not None}
            _check(vectors, len(good), self.job)
            self.embedded.inc(len(good))
        slot = {i: j for j, i in enumerate(good)}
        for i, (shard, row, key, caption, image) in enumerate(batch):
            if i not in slot:
                yield shard, (row, key, caption, None, None, image)
                continue
            text = vectors["text"][slot[i]] if "text" in vectors else None
            yield shard, (row, key, caption, vectors["image"][slot[i]], text, "")

    def _call(self, rows: list[Row]) -> dict[str, Any]:
        """The function over ``rows``; its error is a FunctionError naming it and the first record it fails on."""
        try:
            result: dict[str, Any] = self.fn(np.stack([r[4] for r in rows]), [r[3] for r in rows])
            return result
        except Exception as exc:
            culprit = rows[0]
            for row in rows if len(rows) > 1 else ():  # which record: the first the function fails on alone
                try:
                    self.fn(row[4][None], [row[3]])
                except Exception:
                    culprit = row
                    break
            shard = self.job.numbers[culprit[0]]
            raise FunctionError(
                f"--fn {self.job.fn} failed on record {culprit[2]} of shard {shard}: {type(exc).__name__}: "
                f"{redact(exc)}"
            ) from None


def _check(vectors: dict[str, np.ndarray], rows: int, job: Embedding) -> None:
    if "image" not in vectors:
        raise OptionError(f"--fn {job.fn} returned {sorted(vectors)}; it must return at least 'image'")
    for name, width in (("image", job.image_dim), ("text", job.text_dim)):
        if name in vectors and vectors[name].shape != (rows, width):
            raise OptionError(
                f"--fn {job.fn} returned {name} of shape {vectors[name].shape}, expected ({rows}, {width})"
            )


class _WriteShard(beam.DoFn):  # type: ignore[misc]
    """One shard's files, rows in record order, zero rows where a record could not be read."""

    def __init__(self, job: Embedding) -> None:
        self.job = job

    def process(self, element: tuple[int, Iterable[tuple[int, str, str, Any, Any, str]]]) -> Iterator[dict[str, Any]]:
        shard, rows = element
        ordered = sorted(rows, key=lambda r: r[0])
        expected = self.job.offsets[shard + 1] - self.job.offsets[shard]
        if [r[0] for r in ordered] != list(range(expected)):
            raise RuntimeError(f"embed: shard {shard} got rows {len(ordered)} of {expected}")  # never a shifted row
        options = self.job.plan.storage_options
        images = np.zeros((expected, self.job.image_dim), np.float32)
        texts = np.zeros((expected, self.job.text_dim or 0), np.float32)
        ledger = []
        for row, key, _, image, text, reason in ordered:
            if image is None:
                ledger.append({"shard": self.job.numbers[shard], "row": row, "key": key, "reason": reason})
                continue
            images[row] = image
            if text is not None:
                texts[row] = text
        commit(self.job.file("img_emb", shard), _npy(images), options)
        if self.job.text_dim is not None:
            commit(self.job.file("text_emb", shard), _npy(texts), options)
        commit(self.job.file("metadata", shard, ".parquet"), _parquet(ordered), options)
        yield {"shard": shard, "rows": expected, "bad": ledger}


def _npy(array: np.ndarray) -> Callable[[str], None]:
    def write(path: str) -> None:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        with open(path, "wb") as f:
            f.write(buffer.getvalue())

    return write


def _parquet(rows: list[tuple[int, str, str, Any, Any, str]]) -> Callable[[str], None]:
    def write(path: str) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"key": [r[1] for r in rows], "caption": [r[2] for r in rows]})
        pq.write_table(table, path)

    return write


class _Finish(beam.DoFn):  # type: ignore[misc]
    """Once every shard is written: the ledger and the catalog entries."""

    def __init__(self, job: Embedding) -> None:
        self.job = job

    def process(self, results: list[dict[str, Any]]) -> Iterator[str]:
        results = sorted(results, key=lambda r: r["shard"])
        if [r["shard"] for r in results] != list(range(len(self.job.numbers))):
            raise RuntimeError(f"embed: {len(results)} of {len(self.job.numbers)} shards were written")
        options = self.job.plan.storage_options
        lines = "".join(json.dumps(line) + "\n" for r in results for line in r["bad"])
        commit(self.job.out + "/ledger.jsonl", text_file(lines), options)
        commit(self.job.out + "/catalog.yaml", text_file(entries_yaml(self.job, [r["rows"] for r in results])), options)
        for folder in ("", "/img_emb", "/text_emb", "/metadata"):
            clear_scratch(self.job.out + folder)
        yield self.job.out + "/catalog.yaml"


def entries_yaml(job: Embedding, rows: list[int]) -> str:
    """The catalog entries of the written files: the prior's table and, for tars, the aligned embeddings."""
    plan, root = job.plan, "." if not is_remote(job.out) else job.out
    text = job.text_dim is not None and job.text_dim == job.image_dim
    entries: dict[str, Any] = {
        f"{plan.name}-prior": {
            "description": f"Embeddings of {plan.name} by {job.fn} (datacat embed), for a diffusion prior.",
            "format": "embedding_table",
            "location": {"root": root, "shards": list(job.numbers)},
            "totals": {
                "shards": len(rows),
                "samples": sum(rows),
                "per_shard": dict(zip(job.numbers, rows, strict=True)),
            },
            "prior": {"dim": job.image_dim, "dtype": "float32", "text": text, "captions": True},
        }
    }
    if plan.format == "webdataset":
        if job.source_entry is not None:  # the image entry the embeddings align with, for the file to load alone
            entries = {plan.name: job.source_entry, **entries}
        width = len(job.numbers[0]) if job.numbers else 4
        names = [f"img_emb_{n}.npy" for n in job.numbers]
        entries[f"{plan.name}-img-emb"] = {
            "description": f"Image embeddings of {plan.name} by {job.fn} (datacat embed), aligned with its tar shards.",
            "format": "embeddings",
            "location": {"root": posixpath.join(root, "img_emb"), "shards": names},
            "totals": {"shards": len(rows), "samples": sum(rows), "per_shard": dict(zip(names, rows, strict=True))},
            "loading": {"image_size": plan.loading.image_size, "val_batches": 0},
            "embeddings": {"images": plan.name, "prefix": "img_emb_", "shard_width": width, "dim": job.image_dim},
        }
    return "# Written by datacat embed; every count is exact.\n" + yaml.safe_dump(entries, sort_keys=False, width=120)


def _source_entry(catalog: Catalog, name: str) -> dict[str, Any] | None:
    """Entry ``name`` as written in its catalog file, relative local paths made absolute; None for a built-in one.

    Values stay as the file writes them (``${VAR}`` unexpanded): a secret
    in the environment is not copied into the written catalog.
    """
    canonical = catalog.canonical(name)
    source = catalog.sources[canonical]
    if source.folder == builtin_catalog_dir().resolve():
        return None
    data: dict[str, Any] = catalog[canonical].model_dump(mode="json", exclude_unset=True)

    def anchored(path: str) -> str:
        if "://" in path or "::" in path or path.startswith("${") or os.path.isabs(os.path.expanduser(path)):
            return path
        return os.path.normpath(source.folder / path)

    for location in [data.get("location"), *(data.get("splits") or {}).values()]:
        if location is not None:
            location["root"] = anchored(location["root"])
    captions = (data.get("loading") or {}).get("captions") or {}
    if captions.get("class_names"):
        captions["class_names"] = anchored(captions["class_names"])
    return data


def build(pipeline: beam.Pipeline, job: Embedding) -> Any:
    """Adds the embed job to ``pipeline``; returns the PCollection holding the written catalog file's path."""
    return (
        pipeline
        | "shards" >> beam.Create(range(len(job.numbers)))
        | "spread" >> beam.Reshuffle()
        | "read" >> beam.ParDo(_ReadShard(job))
        | "embed" >> beam.ParDo(_Embed(job))
        | "by shard" >> beam.GroupByKey()
        | "write" >> beam.ParDo(_WriteShard(job))
        | "gather" >> beam.combiners.ToList()
        | "finish" >> beam.ParDo(_Finish(job))
    )


def embed(
    name: str,
    out: str,
    fn: str,
    *,
    catalog: Catalog | None = None,
    batch_size: int = 64,
    options: Any = None,
) -> tuple[str, dict[str, int]]:
    """Runs ``embed`` of entry ``name`` with ``fn`` into ``out``; returns a local path of the catalog file
    it wrote (:func:`~datacat.beam.local_catalog`) and the counters."""
    from datacat.beam import pipeline_options

    if batch_size < 1:
        raise OptionError("--batch-size must be at least 1")
    catalog = load_catalog() if catalog is None else catalog
    plan = resolve(name, catalog=catalog, val_batches=0, count=None, augmentation="none", on_bad_sample="skip")
    if plan.format == "mixture":
        raise OptionError(f"{plan.name} is a mixture: embed each of its components, whose shards the files align with")
    if is_remote(out):
        filesystem(out, plan.storage_options)
    source, _ = whole_epoch(plan)
    offsets = tuple(source.shard_offsets())
    size = plan.loading.image_size
    probe = load_function(fn)(np.zeros((1, size, size, 3), np.uint8), [""])  # the widths, before the job starts
    if "image" not in probe:
        raise OptionError(f"--fn {fn} returned {sorted(probe)}; it must return at least 'image'")
    image_dim = int(np.asarray(probe["image"]).shape[-1])
    text_dim = int(np.asarray(probe["text"]).shape[-1]) if probe.get("text") is not None else None
    job = Embedding(
        plan,
        out.rstrip("/"),
        fn,
        batch_size,
        _numbers(plan),
        offsets,
        image_dim,
        text_dim,
        _source_entry(catalog, name),
    )
    pipeline = beam.Pipeline(options=options or pipeline_options())
    build(pipeline, job)
    counters = run(pipeline, counted=lambda: _counted(job))
    return local_catalog(job.out + "/catalog.yaml", plan.storage_options), counters


def _counted(job: Embedding) -> dict[str, int]:
    """The counters read back from what the job wrote, for a runner that keeps none (the DaskRunner)."""
    entries = yaml.safe_load(read_bytes(job.out + "/catalog.yaml", job.plan.storage_options))
    rows = int(entries[f"{job.plan.name}-prior"]["totals"]["samples"])
    bad = read_bytes(job.out + "/ledger.jsonl", job.plan.storage_options).decode().count("\n")
    return {"records_read": rows, "records_embedded": rows - bad, **({"records_bad": bad} if bad else {})}
