"""``datacat verify``: an entry's shards checked against storage, and a manifest written for later opens.

Storage is listed once; each shard is counted in parallel (tars and remote ArrayRecords indexed,
ArrayRecord footers read) and compared with what the entry declares;
``deep`` also decodes every image. The facts found are written to the
cache's manifest (:mod:`datacat.manifest`), so ``describe``, ``count`` and
``open`` of the entry list nothing and read no footer afterwards.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fnmatch
import hashlib
import posixpath
from collections.abc import Callable
from typing import Any

from datacat.catalog import Catalog, load_catalog
from datacat.errors import OptionError, ShardError
from datacat.formats import RawItem
from datacat.formats.selection import build_selection, stored_sizes
from datacat.limits import deadline
from datacat.loading.sources import SampleSource
from datacat.plan import Plan, Shard
from datacat.planning import resolve
from datacat.registry import MIXTURE, format_names, format_of
from datacat.rules import is_glob, shard_names
from datacat.storage import filesystem, is_remote, with_retries
from datacat.storage.manifests import Manifest, ShardFacts, save_manifest
from datacat.transforms.ledger import BadSample, Ledger

__all__ = ["Report", "ShardReport", "bad_records", "verify"]

Progress = Callable[[str, int, int], None]
"""Called with (stage, done, total) as the work advances."""


@dataclasses.dataclass
class ShardReport:
    """One shard as found: records and bytes against the declared records, and what is wrong."""

    name: str
    url: str
    records: int | None = None
    declared: int | None = None
    bytes: int | None = None
    checksum: str | None = None
    problems: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Report:
    """What ``verify`` found for one entry; ``ok`` when nothing differs from the catalog."""

    entry: str
    base: str
    shards: list[ShardReport]
    absent: list[str]
    """Shards the entry names (and does not declare missing) that storage does not hold."""
    present_but_missing: list[str]
    """Shards the entry declares missing that storage does hold."""
    unexpected: list[str]
    """Files in the shards' folder that the entry does not name."""
    bad_samples: list[BadSample]
    problems: list[str]
    manifest: str | None = None
    selected: int | None = None
    """Records the entry's ``select`` keeps (the selection is then in the cache for every loader)."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["bad_samples"] = [dataclasses.asdict(b) for b in self.bad_samples]
        data["ok"] = self.ok
        return data


def verify(
    name: str,
    *,
    catalog: Catalog | None = None,
    root: str | None = None,
    deep: bool = False,
    threads: int = 16,
    progress: Progress | None = None,
    deep_check: Callable[[Plan], list[BadSample]] | None = None,
) -> Report:
    """Checks one entry's shards against storage and writes their manifest.

    Args:
        name: An entry name or alias.
        catalog: The catalog to look in; default the built-in one plus ``$DATACAT_CATALOG``.
        root: Replaces the entry's root, as in :func:`datacat.resolve`.
        deep: Also read and decode every record, reporting each bad one with shard and key.
        deep_check: Runs the deep check elsewhere: given the plan of the shards found (with their
            counts), returns their bad records, e.g. ``datacat.beam.verify.bad_records_job`` with its
            pipeline options bound (one shard per unit of work on a Beam runner); the rest is the same.
        threads: Shards counted at once.
        progress: Called with (stage, done, total).
    """
    catalog = load_catalog() if catalog is None else catalog
    canonical = catalog.canonical(name)
    entry = catalog[canonical]
    verifiable = [n for n in format_names() if format_of(n).shard_facts is not None]
    if entry.location is None or entry.format == MIXTURE or format_of(entry.format).shard_facts is None:
        raise OptionError(f"{canonical} is {entry.format}: verify checks entries of {', '.join(verifiable)}")
    plan = resolve(canonical, catalog=catalog, root=root, list_shards=False, val_batches=0, count=None)
    say = progress or (lambda stage, done, total: None)
    listing = _list(plan)
    say("listed", 1, 1)
    pattern = entry.location.shards
    if is_glob(pattern):
        named = sorted(n for n in listing if fnmatch.fnmatch(n, str(pattern)))
        declared_missing: set[str] = set()
        shards = [Shard(name=n, url=_join(plan.root, n)) for n in named]
    else:
        named = shard_names(entry.location)
        declared_missing = {posixpath.basename(m) for m in plan.missing}
        shards = list(plan.shards)
    declared = {s.name: s.samples for s in plan.shards} if entry.totals.per_shard else {}
    absent = [s.name for s in shards if s.name not in listing]
    present_but_missing = sorted(n for n in declared_missing if n in listing)
    tables = entry.record.metadata == "parquet"  # img2dataset's NNNNN.parquet beside each tar
    unexpected = sorted(
        n for n in listing if n not in named and not _beside(n) and not (tables and n.endswith(".parquet"))
    )
    problems = [f"shard {n} is named by the entry but absent from {plan.root}" for n in absent]
    problems += [
        f"shard {n} is declared missing but exists; remove it from location.missing" for n in present_but_missing
    ]
    problems += [f"{n} in {plan.root} is not a shard the entry names" for n in unexpected]
    found = [s for s in shards if s.name in listing]
    reports = {
        s.name: ShardReport(s.name, s.url, declared=declared.get(s.name), bytes=listing[s.name][0]) for s in found
    }
    sizes = {name: size for name, (size, _) in listing.items() if size is not None}
    facts = _count(plan, found, sizes, threads, lambda done: say("counted", done, len(found)))
    for shard, fact in zip(found, facts, strict=True):
        report = reports[shard.name]
        if isinstance(fact, BaseException):
            report.problems.append(str(fact))
            continue
        report.records = fact.records
        report.checksum = listing[shard.name][1] or fact.checksum
        fact.checksum = report.checksum
        fact.bytes = report.bytes
        if report.declared is not None and report.declared != fact.records:
            report.problems.append(f"holds {fact.records} records, the entry declares {report.declared}")
    for report in reports.values():
        problems += [f"shard {report.name}: {p}" for p in report.problems]
    counted = [r.records for r in reports.values()]
    if entry.totals.samples is not None and not absent and all(c is not None for c in counted):
        total = sum(c or 0 for c in counted)
        if entry.totals.per_shard and total != entry.totals.samples:
            problems.append(f"the shards hold {total} records, the entry declares {entry.totals.samples}")
    bad: list[BadSample] = []
    readable = [(s, f) for s, f in zip(found, facts, strict=True) if isinstance(f, ShardFacts)]
    if deep and readable:
        shards_read, facts_read = zip(*readable, strict=True)
        checked = _checked_plan(plan, list(shards_read), list(facts_read))
        if deep_check is not None:
            bad = deep_check(checked)
        else:
            bad = _decode_all(checked, lambda done, total: say("decoded", done, total))
        problems += [f"bad record: {b}" for b in bad]
    selected = None
    complete = not absent and not any(isinstance(f, BaseException) for f in facts)
    if complete and (plan.select or plan.loading.buckets is not None):
        # What a loader would build at its first open, built here once for every host.
        counted_plan = plan.model_copy(update={"shards": tuple(found)})
        counts = [f.records for f in facts if isinstance(f, ShardFacts)]
        try:
            if plan.select:
                selected = len(build_selection(counted_plan, counts))
            if plan.loading.buckets is not None:
                stored_sizes(counted_plan, counts)
        except ShardError as exc:
            problems.append(str(exc))
    manifest_path = None
    if complete:
        manifest = Manifest(
            plan.manifest,
            canonical,
            plan.root,
            {s.name: f for s, f in zip(found, facts, strict=True) if isinstance(f, ShardFacts)},
            verified=not problems,
        )
        manifest_path = str(save_manifest(manifest))
    return Report(
        canonical,
        plan.root,
        list(reports.values()),
        absent,
        present_but_missing,
        unexpected,
        bad,
        problems,
        manifest_path,
        selected,
    )


def _join(base: str, name: str) -> str:
    return posixpath.join(base, name) if "://" in base else f"{base.rstrip('/')}/{name}"


def _list(plan: Plan) -> dict[str, tuple[int | None, str | None]]:
    """Files directly in the shards' folder: name -> (bytes, storage checksum)."""
    fs, path = filesystem(plan.root, plan.storage_options)
    try:
        entries = with_retries(lambda: fs.ls(path, detail=True, **deadline(fs)), plan.root)
    except FileNotFoundError:
        raise FileNotFoundError(2, f"folder not found: {plan.root}; check the entry's root", plan.root) from None
    out: dict[str, tuple[int | None, str | None]] = {}
    for info in entries:
        if info.get("type") == "directory":
            continue
        checksum = info.get("md5Hash") or info.get("crc32c") or info.get("ETag")
        out[posixpath.basename(info["name"].rstrip("/"))] = (info.get("size"), checksum)
    return out


def _count(
    plan: Plan, shards: list[Shard], sizes: dict[str, int], threads: int, advance: Callable[[int], None]
) -> list[ShardFacts | BaseException]:
    """Each shard's facts (records, index), or the error that kept it from being read."""
    if not shards:
        return []
    counter = format_of(plan.format).shard_facts
    assert counter is not None  # verify() checked
    count_one = counter(plan.model_copy(update={"shards": tuple(shards)}), sizes)

    def attempt(i: int) -> ShardFacts | BaseException:
        try:
            fact = count_one(i)
        except (ShardError, OSError) as exc:
            return exc
        if fact.checksum is None and not is_remote(shards[i].url):
            fact.checksum = "md5:" + _md5(shards[i].url)
        return fact

    out: list[ShardFacts | BaseException] = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for fact in pool.map(attempt, range(len(shards))):
            out.append(fact)
            advance(len(out))
    return out


_SIDECARS = (".json", ".jsonl", ".yaml", ".yml", ".txt", ".md")


def _beside(name: str) -> bool:
    """Whether a file is one kept beside shards, never a shard: a catalog entry, a report, TFDS's
    dataset_info.json and label names, a hidden folder of unfinished writes."""
    return name.startswith(".") or name.lower().endswith(_SIDECARS)


def _md5(path: str) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path.removeprefix("file://"), "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _checked_plan(plan: Plan, shards: list[Shard], facts: list[ShardFacts]) -> Plan:
    """The plan of the shards found, with the counts found, read without augmentation."""
    counted = [f.records for f in facts]
    return plan.model_copy(
        update={
            "shards": tuple(s.model_copy(update={"samples": n}) for s, n in zip(shards, counted, strict=True)),
            "glob": None,
            "loading": plan.loading.model_copy(update={"augmentation": "none"}),
        }
    )


def _decode_all(checked: Plan, advance: Callable[[int, int], None]) -> list[BadSample]:
    source = SampleSource(checked)
    bad: list[BadSample] = []
    total = sum(s.samples or 0 for s in checked.shards)
    done = 0
    for shard in range(len(checked.shards)):
        bad += bad_records(source, shard)
        done += checked.shards[shard].samples or 0
        advance(done, total)
    return bad


def bad_records(source: SampleSource, shard: int) -> list[BadSample]:
    """Every record of one shard read and decoded (no augmentation), and the ones that fail.

    A shard that cannot be read at all raises (a ShardError naming it).
    What ``verify --deep`` runs per shard, on one machine or as a Beam job.
    """
    ledger = Ledger(source.plan.name, policy="skip", budget=1.0)
    reader = source.reader
    if reader.random_access:
        first = sum(reader.counts[:shard])
        stop = first + reader.counts[shard]
        for start in range(first, stop, 64):
            positions = range(start, min(stop, start + 64))
            try:
                items: list[RawItem | BaseException] = list(reader.items(positions))
            except (ShardError, OSError) as exc:
                items = [exc] * len(positions)
            for position, item in zip(positions, items, strict=True):
                if isinstance(item, ShardError | OSError):
                    raise item
                ledger.admit(source.outcome(item, position))
    else:
        for position, raw in enumerate(reader.iter_shard(shard)):
            ledger.admit(source.outcome(raw, position))
    return list(ledger.skipped)
