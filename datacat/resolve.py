"""An entry plus the caller's options, resolved to a Plan both backends run.

A Plan is plain frozen data: the concrete shard URLs in a stable order with
missing shards left out, the record layout, the transform settings,
normalised mixture weights and the record counts where they are known. It
knows no framework; ``describe`` prints it, backends consume it, and its
fingerprint identifies it in a saved loader state.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from datacat.catalog import Catalog, EntrySource, load_catalog
from datacat.errors import OptionError, ShardError, storage_failure
from datacat.interpolate import interpolate, interpolate_all
from datacat.manifest import load_manifest, manifest_key
from datacat.redact import redact, remember
from datacat.registry import format_of
from datacat.rules import escapes_root, is_glob, shard_names
from datacat.schema import Embeddings, Entry, Exhaustion, Loading, Location, Prior, Record
from datacat.shards import brace_numbers

__all__ = ["Plan", "PlanComponent", "Shard", "override_loading", "resolve"]

_SECRET_KEY = re.compile(r"token|secret|password|passwd|credential|key", re.IGNORECASE)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Shard(_Frozen):
    """One shard that exists: its name in the pattern, its URL, its record count if declared."""

    name: str
    url: str
    samples: int | None = None


class PlanComponent(_Frozen):
    """One dataset of a mixture and its normalised sampling weight."""

    weight: float
    plan: Plan


class Plan(_Frozen):
    """Everything a backend needs to load one split of one entry, framework-free."""

    name: str
    format: str
    access: str
    split: str
    seed: int
    root: str
    shards: tuple[Shard, ...] = ()
    missing: tuple[str, ...] = ()
    glob: str | None = None
    """A glob of shard URLs not yet listed (``resolve(list_shards=False)``)."""
    samples: int | None = None
    samples_exact: bool = False
    samples_counted: bool = False
    """Some shard's count came from reading it (the manifest cache), not from the catalog."""
    bytes: int | None = None
    record: Record = Record()
    loading: Loading = Loading()
    batch_size: int | None = None
    components: tuple[PlanComponent, ...] = ()
    exhaustion: Exhaustion | None = None
    embeddings: Embeddings | None = None
    prior: Prior | None = None
    images: Plan | None = None
    """For an embeddings entry: the plan of the image shards it aligns with."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False, exclude=True)
    storage_options_shown: dict[str, Any] = {}
    """storage_options as the catalog writes them (``${VAR}`` unexpanded, literal secrets redacted)."""
    source: str = ""
    overrides: tuple[str, ...] = ()

    manifest: str = ""
    """The key of this shard set's manifest in the cache (see :mod:`datacat.manifest`)."""
    from_holdout: bool = False
    """A ``validation`` split read from the head of the train shards (no split of its own)."""

    @property
    def holdout_records(self) -> int:
        """Records held out of the head of the train shards for validation (0 when none)."""
        if (self.split != "train" and not self.from_holdout) or not self.loading.val_batches or self.loading.val_split:
            return 0
        if self.batch_size is None:
            return 0
        return self.loading.val_batches * self.batch_size

    def to_json(self) -> dict[str, Any]:
        """The Plan as JSON-able data, without the expanded storage options (they may hold secrets)."""
        return self.model_dump(mode="json")

    def fingerprint(self) -> str:
        """A short hash of what decides the stream: shards, weights, layout, seed, options."""
        return hashlib.sha256(json.dumps(self._identity(), sort_keys=True).encode()).hexdigest()[:16]

    def _identity(self) -> dict[str, Any]:
        # Where the catalog file was read from, and how it was shown, do not change the data; nor do record
        # counts, which a manifest may supply on one run and reading the shards on another (a loader's state
        # carries the epoch's length and checks it instead).
        data = self.model_dump(
            mode="json",
            exclude={
                "storage_options_shown",
                "source",
                "overrides",
                "components",
                "images",
                "manifest",
                "samples",
                "samples_exact",
                "samples_counted",
            },
        )
        data["shards"] = [(s["name"], s["url"]) for s in data["shards"]]
        data["components"] = [(c.weight, c.plan._identity()) for c in self.components]
        data["images"] = self.images._identity() if self.images is not None else None
        return data


def resolve(
    name: str,
    *,
    split: str = "train",
    root: str | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    catalog: Catalog | None = None,
    list_shards: bool = True,
    env: Mapping[str, str] | None = None,
    **options: Any,
) -> Plan:
    """The Plan for one split of a catalog entry.

    Args:
        name: An entry name or alias, in any case.
        split: ``"train"`` (the entry's ``location``) or a name under its ``splits``.
        root: Replaces the entry's root (and its components'); default ``$DATACAT_ROOT`` where the entry uses it.
        seed: The seed every shuffle and augmentation derives from.
        batch_size: Needed to turn ``val_batches`` into a number of held-out records.
        catalog: The catalog to look in; default the built-in one plus ``$DATACAT_CATALOG``.
        list_shards: List glob shard specs now (may touch storage); otherwise the Plan keeps the glob.
        options: Overrides of the entry's ``loading`` section, e.g. ``image_size=256``.

    Example:
        >>> plan = datacat.resolve("cc3m", root="/data/msml612")
        >>> len(plan.shards)
        49
    """
    catalog = load_catalog() if catalog is None else catalog
    return _resolve(catalog, catalog.canonical(name), split, root, seed, batch_size, list_shards, env, options, ())


def _resolve(
    catalog: Catalog,
    name: str,
    split: str,
    root: str | None,
    seed: int,
    batch_size: int | None,
    list_shards: bool,
    env: Mapping[str, str] | None,
    options: Mapping[str, Any],
    trail: tuple[str, ...],
) -> Plan:
    entry, source = catalog[name], catalog.sources[name]
    loading = override_loading(name, entry.loading, options)
    names_file = loading.captions.class_names
    if names_file and "captions" not in options and "://" not in names_file and not os.path.isabs(names_file):
        # The entry's own class-names file is relative to its catalog file, like location.root.
        anchored = os.path.normpath(source.folder / os.path.expanduser(names_file))
        loading = loading.model_copy(update={"captions": loading.captions.model_copy(update={"class_names": anchored})})
    info = format_of(entry.format)
    if entry.prior is not None and loading.val_batches:
        loading = loading.model_copy(update={"val_batches": 0})  # split by declared rows, never by batch counts
    common: dict[str, Any] = dict(
        name=name,
        format=entry.format,
        access=info.access,
        split=split,
        seed=seed,
        loading=loading,
        batch_size=batch_size,
        source=source.file,
        overrides=source.overrides,
        record=entry.record.model_copy(update={"layout": entry.record.layout or (info.layouts or (None,))[0]}),
    )
    if entry.mixture is not None:
        return _resolve_mixture(
            catalog, name, entry, common, split, root, seed, batch_size, list_shards, env, options, trail
        )
    location, from_holdout = _location(name, entry, split, loading)
    train_shards = split == "train" or from_holdout
    base, storage_options = _base_url(location, source, root, env)
    names = [] if is_glob(location.shards) else shard_names(location)
    missing = _missing_names(location, names)
    key = manifest_key(entry.format, base, location.shards, tuple(sorted(missing)))
    manifest = load_manifest(key)
    known = {} if manifest is None else {n: f.records for n, f in manifest.shards.items()}
    per_shard = {**known, **((entry.totals.per_shard or {}) if train_shards else {})}
    shards = [Shard(name=n, url=_join(base, n), samples=per_shard.get(n)) for n in names if n not in missing]
    glob = None
    if is_glob(location.shards):
        glob = _join(base, str(location.shards))
        if manifest is not None:  # listed before: the manifest's shards, no listing now
            shards = [Shard(name=f.name, url=f.url, samples=f.records) for f in manifest.shards.values()]
            glob = None
        elif list_shards:
            shards = _list_glob(glob, storage_options)
            glob = None
    exact = bool(shards) and train_shards and all(s.samples is not None for s in shards)
    samples = (
        sum(s.samples or 0 for s in shards) if exact else (entry.totals.samples if train_shards else location.samples)
    )
    declared = set(entry.totals.per_shard or {}) if train_shards else set()
    counted = exact and any(s.name not in declared for s in shards)
    images = None
    if entry.embeddings is not None and entry.embeddings.images is not None:
        images = _resolve(
            catalog,
            catalog.canonical(entry.embeddings.images),
            split,
            root,
            seed,
            batch_size,
            list_shards,
            env,
            options,
            (*trail, name),
        )
    return Plan(
        **common,
        root=base,
        shards=tuple(shards),
        missing=tuple(_join(base, m) for m in names if m in missing),
        glob=glob,
        samples=samples,
        samples_exact=exact,
        samples_counted=counted,
        bytes=entry.totals.bytes if train_shards else None,
        from_holdout=from_holdout,
        manifest=key,
        embeddings=entry.embeddings,
        prior=entry.prior,
        images=images,
        storage_options=storage_options,
        storage_options_shown=_shown(location.storage_options),
    )


def _resolve_mixture(
    catalog: Catalog,
    name: str,
    entry: Entry,
    common: dict[str, Any],
    split: str,
    root: str | None,
    seed: int,
    batch_size: int | None,
    list_shards: bool,
    env: Mapping[str, str] | None,
    options: Mapping[str, Any],
    trail: tuple[str, ...],
) -> Plan:
    assert entry.mixture is not None  # the caller checked; narrows the type
    if name in trail:
        raise OptionError(f"mixture cycle: {' -> '.join([*trail, name])}")
    parts = []
    # What the mixture's own entry says of loading applies to every component, then the caller's options.
    inherited = {**{k: getattr(entry.loading, k) for k in entry.loading.model_fields_set}, **options}
    for component in entry.mixture.components:
        plan = _resolve(
            catalog,
            catalog.canonical(component.name),
            split,
            root,
            seed,
            batch_size,
            list_shards,
            env,
            inherited,
            (*trail, name),
        )
        weight = component.weight if component.weight is not None else float(plan.samples or 0)
        parts.append((weight, plan))
    total = sum(w for w, _ in parts)
    components = tuple(PlanComponent(weight=w / total, plan=p) for w, p in parts)
    counts = [p.samples for _, p in parts]
    known = all(c is not None for c in counts)
    sizes = [p.bytes for _, p in parts]
    return Plan(
        **common,
        root=root or "",
        components=components,
        exhaustion=entry.mixture.exhaustion,
        samples=sum(c or 0 for c in counts) if known else entry.totals.samples,
        samples_exact=all(p.samples_exact for _, p in parts),
        bytes=sum(b or 0 for b in sizes) if all(b is not None for b in sizes) else entry.totals.bytes,
    )


def override_loading(name: str, loading: Loading, options: Mapping[str, Any]) -> Loading:
    """``loading`` with ``options`` applied, validated; an unknown or invalid option is an ``OptionError``."""
    if not options:
        return loading
    unknown = set(options) - set(Loading.model_fields)
    if unknown:
        raise OptionError(
            f"{name}: unknown loading option(s) {', '.join(sorted(unknown))}; known: {', '.join(Loading.model_fields)}"
        )
    try:
        return Loading.model_validate({**loading.model_dump(), **options})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})" for e in exc.errors())
        raise OptionError(f"{name}: {problems}") from None


def _location(name: str, entry: Entry, split: str, loading: Loading) -> tuple[Location, bool]:
    """The location of ``split`` and whether it is the holdout at the head of the train shards."""
    assert entry.location is not None  # validated: every non-mixture format needs a location
    if split == "train":
        return entry.location, False
    if split in entry.splits:
        return entry.splits[split], False
    if split == "validation" and loading.val_split:
        return entry.splits[loading.val_split], False
    if split == "validation" and entry.prior is not None and entry.prior.validation_rows is not None:
        return entry.location, False  # the same tables; the reader keeps the declared rows
    if split == "validation" and loading.val_batches:
        return entry.location, True
    known = ", ".join(["train", *entry.splits, *(["validation (the holdout)"] if loading.val_batches else [])])
    raise OptionError(f"{name} has no split {split!r} (it has: {known})")


def _base_url(
    location: Location, source: EntrySource, root: str | None, env: Mapping[str, str] | None
) -> tuple[str, dict[str, Any]]:
    try:
        base = root if root is not None else interpolate(location.root, env)
        storage_options = interpolate_all(dict(location.storage_options), env)
        remember(storage_options)  # never printed from here on, in any message or log line
        path = interpolate(location.path, env)
    except KeyError as exc:
        raise OptionError(f"${{{exc.args[0]}}} is not set; export it or pass root=") from None
    if "://" not in base and "::" not in base:
        folder = source.folder if root is None else Path.cwd()
        base = os.path.normpath(folder / os.path.expanduser(base))
    return _join(base, path) if path else base.rstrip("/"), storage_options


def _join(base: str, name: str) -> str:
    if escapes_root(name):  # validation refuses these; a name from elsewhere (a listing) must not slip out either
        raise OptionError(f"{name!r} would leave the root {base}; shard names and paths stay inside it")
    if "://" in base:
        return base + name if base.endswith("/") else f"{base}/{name}"  # posixpath.join, for a relative name
    return os.path.join(base, name)


def _missing_names(location: Location, names: list[str]) -> set[str]:
    numbers = brace_numbers(location.shards) if isinstance(location.shards, str) else None
    out = set()
    for item in location.missing:
        if isinstance(item, int) and numbers is not None:
            out.add(names[numbers.index(item)])
        elif isinstance(item, str):
            out.add(item)
    return out


def _list_glob(glob: str, storage_options: Mapping[str, Any]) -> list[Shard]:
    import fsspec  # the storage layer is needed only when a glob must be listed

    remember(storage_options)
    try:
        fs, path = fsspec.core.url_to_fs(glob, **storage_options)
        found = sorted(fs.glob(path))
    except Exception as exc:  # sorted here: storage failures and refused options are translated, bugs propagate
        if not (storage_failure(exc) or isinstance(exc, ValueError | TypeError)):
            raise
        raise ShardError(
            f"cannot list shards {glob}: {type(exc).__name__}: {redact(exc)}. Check the network and the credentials "
            "in storage_options, or set DATACAT_ROOT (or root=)",
            url=glob,
        ) from None
    if not found:
        raise ShardError(f"no shards match {glob}; check the entry's root and path")
    folder = posixpath.dirname(glob) if "://" in glob else os.path.dirname(glob)
    shards = []
    for item in found:
        name = posixpath.basename(item)
        # Keep the URL as the catalog spells it when the glob is in the file name only.
        url = _join(folder, name) if not is_glob(folder) else fs.unstrip_protocol(item)
        shards.append(Shard(name=name, url=url))
    return shards


def _shown(options: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(value, Mapping):
            out[key] = _shown(value)
        elif isinstance(value, str) and _SECRET_KEY.search(key) and "${" not in value:
            out[key] = "<redacted>"
        else:
            out[key] = value
    return out


PlanComponent.model_rebuild()
Plan.model_rebuild()
