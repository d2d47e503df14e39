"""``datacat convert``: any catalog entry to ArrayRecord shards, as a Beam pipeline.

The entry's records are read in canonical order (shards in plan order,
records in shard order; a mixture's epoch-0 sequence, unshuffled) and cut
into output shards of ``records_per_shard`` positions each: output shard
``k`` holds positions ``[k * n, (k + 1) * n)``, so its bytes depend on
nothing but ``k``, whatever the runner's parallelism or retries. A record
that cannot be read or decoded is left out and reported (``bad_records.jsonl``
and the ``bad`` counter); each shard's exact count goes into the catalog
entry written beside the shards.

Layouts: ``packed`` keeps the encoded image as read (``jpg``), with the
caption the loader would give (``txt``), the source key (``key``) and the
label (``cls``) when there is one; ``pre_resized`` stores the pixels of the
entry's transform at its image size, without augmentation, uncompressed (a loader
copies them from the file straight into its batches).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import apache_beam as beam
import yaml

from datacat.beam import clear_scratch, commit, counter, local_catalog, part_of, run, text_file, whole_epoch
from datacat.catalog import Catalog, load_catalog
from datacat.errors import OptionError
from datacat.formats.packed import pack_record
from datacat.plan import Plan
from datacat.planning import resolve
from datacat.registry import format_of
from datacat.storage import filesystem, is_remote, read_bytes
from datacat.transforms.ledger import BadSample

__all__ = ["Conversion", "convert", "converted_records"]

_BATCH = 64
"""Records fetched at once (one concurrent read for random-access sources)."""


@dataclasses.dataclass(frozen=True)
class Conversion:
    """What a ``convert`` job makes: where, in which layout, how many records per shard."""

    plan: Plan
    out: str
    layout: str = "packed"
    records_per_shard: int = 1000
    name: str = ""
    """The new entry's name; default ``<entry>-converted``."""
    written_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The source entry's storage_options as written in its catalog (``${VAR}`` kept, never the values)."""
    records: int = 0
    """Records in the converted sequence."""
    image_only: bool = False
    image_size: int = 0
    """The size the records' images are transformed to (a mixture's components share one)."""
    counts: tuple[int, ...] = ()
    """Records per source shard (not for a mixture, whose draws need every component open)."""

    @property
    def entry_name(self) -> str:
        return self.name or f"{self.plan.name}-converted"

    def shard_name(self, k: int, shards: int) -> str:
        return f"data-{k:05d}-of-{shards:05d}.array_record"


def _open_view(plan: Plan) -> Any:
    return whole_epoch(plan)[1]


def _record_of(view: Any, item: Any, position: int, layout: str, mixture: bool = False) -> bytes | BadSample:
    """The output record of one fetched item, or why it is left out."""
    source = view.source  # the component's source, for a mixture
    name = source.plan.name
    if isinstance(item, ValueError):  # RecordError too: the record cannot be split out of its shard
        return BadSample(
            name, getattr(item, "url", "") or "", getattr(item, "key", "") or f"record {position}", str(item)
        )
    if isinstance(item, BaseException):  # the shard cannot be read: the bundle fails, the runner retries it
        raise item
    try:
        record = source.reader.parse(item)
        sample = source.transform(record)
    except ValueError as exc:
        return BadSample(name, item.shard, item.key, str(exc))
    entries: dict[str, bytes | memoryview | str] = {}
    if layout == "pre_resized":
        image = sample["image"]
        entries["image"] = image.tobytes()
        entries["shape"] = struct.pack("<ii", image.shape[0], image.shape[1])
    else:
        raw = record.get("image")
        if not isinstance(raw, bytes | memoryview):
            raise OptionError(f"{name} holds decoded pixels, not encoded images: convert it with --layout pre_resized")
        entries["jpg"] = raw
    if "caption" in sample:
        entries["txt" if layout == "packed" else "caption"] = sample["caption"]
    entries["key"] = sample["key"]
    if mixture:  # keys are unique within a component only
        entries["component"] = name
    if "label" in sample:
        entries["cls" if layout == "packed" else "label"] = str(sample["label"])
    return pack_record(entries)


def converted_records(view: Any, positions: Sequence[int], layout: str) -> Iterator[bytes | BadSample]:
    """The output records of view positions ``positions``, in order (bad ones as BadSample)."""
    mixture = view.source.plan.format == "mixture"
    for start in range(0, len(positions), _BATCH):
        chunk = positions[start : start + _BATCH]
        for fetched_view, item, position in view.fetch(chunk):
            yield _record_of(fetched_view, item, position, layout, mixture)


class _WriteShard(beam.DoFn):  # type: ignore[misc]
    """Writes output shard ``k``: its records read, converted and committed whole."""

    def __init__(self, job: Conversion, total: int, shards: int) -> None:
        self.job, self.total, self.shards = job, total, shards
        self.read, self.written, self.bad = counter("records_read"), counter("records_written"), counter("records_bad")

    def setup(self) -> None:
        self.opened: tuple[tuple[int, int], Any] | None = None
        self.offsets = tuple(itertools.accumulate(self.job.counts, initial=0))

    def _view(self, positions: range) -> tuple[Any, int]:
        """A view of the source shards holding ``positions`` (all of a mixture), and its first position."""
        if not self.job.counts:
            if self.opened is None:
                self.opened = ((0, 0), _open_view(self.job.plan))
            return self.opened[1], 0
        first = bisect.bisect_right(self.offsets, positions.start) - 1
        stop = bisect.bisect_left(self.offsets, positions.stop)
        if self.opened is None or self.opened[0] != (first, stop):  # consecutive units often share shards
            self.opened = ((first, stop), _open_view(part_of(self.job.plan, first, stop, self.job.counts)))
        return self.opened[1], self.offsets[first]

    def process(self, k: int) -> Iterator[tuple[int, int, list[BadSample]]]:
        from array_record.python import array_record_module

        n = self.job.records_per_shard
        positions = range(k * n, min(self.total, (k + 1) * n))
        view, base = self._view(positions)
        records: list[bytes] = []
        bad: list[BadSample] = []
        for result in converted_records(view, range(positions.start - base, positions.stop - base), self.job.layout):
            if isinstance(result, BadSample):
                bad.append(result)
            else:
                records.append(result)
        self.read.inc(len(positions))
        self.bad.inc(len(bad))

        def write(path: str) -> None:
            # Each record its own chunk; pixels uncompressed, so a loader copies them straight into its batch
            # (datacat.formats.ar_pixels): zstd made every read decompress, for 0.8 of the size.
            options = "group_size:1,uncompressed" if self.job.layout == "pre_resized" else "group_size:1"
            writer = array_record_module.ArrayRecordWriter(path, options)
            for record in records:
                writer.write(record)
            writer.close()

        url = self.job.out.rstrip("/") + "/" + self.job.shard_name(k, self.shards)
        commit(url, write, self.job.plan.storage_options)
        self.written.inc(len(records))
        yield k, len(records), bad


class _Finish(beam.DoFn):  # type: ignore[misc]
    """Once every shard is written: the catalog entry and the bad-record report beside them."""

    def __init__(self, job: Conversion, shards: int) -> None:
        self.job, self.shards, self.storage_options = job, shards, job.plan.storage_options

    def process(self, results: list[tuple[int, int, list[BadSample]]]) -> Iterator[str]:
        results = sorted(results)
        if [k for k, _, _ in results] != list(range(self.shards)):
            raise RuntimeError(f"convert: {len(results)} of {self.shards} shards were written")
        per_shard = {self.job.shard_name(k, self.shards): n for k, n, _ in results}
        bad = [b for _, _, found in results for b in found]
        out = self.job.out.rstrip("/")
        text = "\n".join(json.dumps(dataclasses.asdict(b)) for b in bad)
        commit(out + "/bad_records.jsonl", text_file(text + ("\n" if text else "")), self.storage_options)
        commit(out + "/catalog.yaml", text_file(entry_yaml(self.job, per_shard)), self.storage_options)
        clear_scratch(out)
        yield out + "/catalog.yaml"


def entry_yaml(job: Conversion, per_shard: dict[str, int]) -> str:
    """The catalog entry of the converted shards (YAML), exact per-shard counts included."""
    plan, shards = job.plan, len(per_shard)
    pattern = f"data-{{{0:05d}..{shards - 1:05d}}}-of-{shards:05d}.array_record"
    labelled = plan.record.label is not None or plan.record.layout == "tf_example"
    entry: dict[str, Any] = {
        "description": f"{plan.name} converted to ArrayRecord ({job.layout}) by datacat convert.",
        "format": "array_record",
        "location": {"root": "." if not is_remote(job.out) else job.out.rstrip("/"), "shards": pattern},
        "totals": {"shards": shards, "samples": sum(per_shard.values()), "per_shard": per_shard},
        "loading": {"image_size": job.image_size or plan.loading.image_size, "val_batches": 0},
    }
    if job.written_options and is_remote(job.out):
        entry["location"]["storage_options"] = job.written_options
    if job.layout == "packed":
        entry["record"] = {"layout": "packed", "image": "jpg", "caption": "txt", "key": "key"}
        if labelled:
            entry["record"]["label"] = "cls"
    else:
        entry["record"] = {"layout": "pre_resized", "key": "key"}
    if job.image_only:
        entry["record"]["caption"] = None
    text = yaml.safe_dump({job.entry_name: entry}, sort_keys=False, width=120)
    return "# Written by datacat convert; every count is exact.\n" + text


def build(pipeline: beam.Pipeline, job: Conversion) -> Any:
    """Adds the convert job to ``pipeline``; returns the PCollection holding the written entry's path."""
    total = job.records
    shards = max(1, math.ceil(total / job.records_per_shard))
    written = (
        pipeline
        | "shards" >> beam.Create(range(shards))
        | "spread" >> beam.Reshuffle()
        | "write" >> beam.ParDo(_WriteShard(job, total, shards))
    )
    return written | "gather" >> beam.combiners.ToList() | "finish" >> beam.ParDo(_Finish(job, shards))


def _survey(plan: Plan) -> tuple[int, bool, int, tuple[int, ...]]:
    """(records in the converted sequence, whether they are image-only, their image size, records per shard),
    read where the job starts."""
    from datacat.loading.mixture import MixtureSource, open_source

    source = open_source(plan)
    sources = source.components if isinstance(source, MixtureSource) else [source]
    image_only = all(getattr(s.transform, "image_only", False) for s in sources)
    offsets = () if isinstance(source, MixtureSource) else source.shard_offsets()
    counts = tuple(b - a for a, b in itertools.pairwise(offsets))
    return int(source.epoch_length(plan.seed, 0)), image_only, sources[0].plan.loading.image_size, counts


def convert(
    name: str,
    out: str,
    *,
    catalog: Catalog | None = None,
    layout: str = "packed",
    records_per_shard: int = 1000,
    entry_name: str = "",
    options: Any = None,
) -> tuple[str, dict[str, int]]:
    """Runs ``convert`` of entry ``name`` to ``out``; returns a local path of the catalog file it wrote
    (:func:`~datacat.beam.local_catalog`) and the job's counters."""
    from datacat.beam import pipeline_options

    if layout not in ("packed", "pre_resized"):
        raise OptionError(f"--layout {layout!r}: use packed or pre_resized")
    if records_per_shard < 1:
        raise OptionError("--records-per-shard must be at least 1")
    catalog = load_catalog() if catalog is None else catalog
    plan = resolve(name, catalog=catalog, val_batches=0, count=None, augmentation="none", on_bad_sample="skip")
    plans = [c.plan for c in plan.components] if plan.format == "mixture" else [plan]
    if any(format_of(p.format).rows for p in plans):
        raise OptionError(f"{name} holds embedding rows, not images: there is nothing to convert to image records")
    if layout == "packed" and any(p.record.layout == "pre_resized" for p in plans):
        raise OptionError(f"{name} holds decoded pixels, not encoded images: convert it with --layout pre_resized")
    if is_remote(out):
        filesystem(out, plan.storage_options)  # a bucket that cannot be reached fails here, before the job starts
    entry = catalog[catalog.canonical(name)]
    written = dict(entry.location.storage_options) if entry.location is not None else {}
    records, image_only, size, counts = _survey(plan)
    job = Conversion(
        plan, out.rstrip("/"), layout, records_per_shard, entry_name, written, records, image_only, size, counts
    )
    pipeline = beam.Pipeline(options=options or pipeline_options())
    build(pipeline, job)
    counters = run(pipeline, counted=lambda: _counted(job))
    return local_catalog(job.out + "/catalog.yaml", plan.storage_options), counters


def _counted(job: Conversion) -> dict[str, int]:
    """The counters read back from what the job wrote, for a runner that keeps none (the DaskRunner)."""
    entry = next(iter(yaml.safe_load(read_bytes(job.out + "/catalog.yaml", job.plan.storage_options)).values()))
    bad = read_bytes(job.out + "/bad_records.jsonl", job.plan.storage_options).decode().count("\n")
    written = int(entry["totals"]["samples"])
    return {"records_read": written + bad, "records_written": written, "records_bad": bad}
