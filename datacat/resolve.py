"""An entry plus the caller's options, resolved to a Plan with no I/O.

Resolution reads only the catalog: the shard URLs its pattern names (a glob
stays unlisted in ``Plan.glob``), the record counts it declares, the loading
options with the caller's overrides applied and validated, each mixture
component and an embeddings entry's image entry resolved alike. The storage
layer completes the Plan (:func:`datacat.storage.complete_plan`: globs
listed, counts from the manifest cache); :func:`datacat.resolve` does both.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

from pydantic import ValidationError

from datacat.catalog import Catalog, EntrySource
from datacat.errors import OptionError
from datacat.interpolate import interpolate, interpolate_all
from datacat.plan import Plan, PlanComponent, Shard, manifest_key, mixture_samples, weigh_components
from datacat.redact import remember
from datacat.registry import MIXTURE, format_of
from datacat.rules import escapes_root, is_glob, shard_names
from datacat.schema import (
    Augmentation,
    BadSamplePolicy,
    Buckets,
    Captions,
    Entry,
    Loading,
    Location,
    ResizeMode,
)
from datacat.shards import brace_numbers

__all__ = ["LoadingOverrides", "join_url", "override_loading", "resolve_entry"]

_SECRET_KEY = re.compile(r"token|secret|password|passwd|credential|key", re.IGNORECASE)


class LoadingOverrides(TypedDict, total=False):
    """Overrides of an entry's ``loading`` section, by field (see :class:`datacat.schema.Loading`)."""

    image_size: int
    augmentation: Augmentation
    resize: ResizeMode
    val_batches: int | None
    val_split: str | None
    count: int | None
    on_bad_sample: BadSamplePolicy
    bad_sample_budget: float
    captions: Captions | Mapping[str, object]
    max_pixels: int
    read_ahead: int | str
    size_conditioning: bool
    buckets: Buckets | Mapping[str, object] | None


def resolve_entry(
    name: str,
    *,
    catalog: Catalog,
    split: str = "train",
    root: str | None = None,
    seed: int = 0,
    batch_size: int | None = None,
    env: Mapping[str, str] | None = None,
    loading: Mapping[str, object] | None = None,
) -> Plan:
    """The Plan of one split of a catalog entry as the catalog alone gives it: no storage is read.

    Arguments are those of :func:`datacat.resolve`; ``loading`` holds its
    overrides of the entry's ``loading`` section.
    """
    return _resolve(catalog, catalog.canonical(name), split, root, seed, batch_size, env, dict(loading or {}), ())


def _resolve(
    catalog: Catalog,
    name: str,
    split: str,
    root: str | None,
    seed: int,
    batch_size: int | None,
    env: Mapping[str, str] | None,
    options: Mapping[str, object],
    trail: tuple[str, ...],
) -> Plan:
    entry, source = catalog[name], catalog.sources[name]
    loading = override_loading(name, entry.loading, options)
    names_file = loading.captions.class_names
    if names_file and "captions" not in options and "://" not in names_file and not os.path.isabs(names_file):
        # The entry's own class-names file is relative to its catalog file, like location.root.
        anchored = os.path.normpath(source.folder / os.path.expanduser(names_file))
        loading = loading.model_copy(update={"captions": loading.captions.model_copy(update={"class_names": anchored})})
    if entry.format == MIXTURE:
        info = None
    else:
        info = format_of(entry.format)
        if not info.val_batches and loading.val_batches:
            loading = loading.model_copy(update={"val_batches": 0})  # the format splits its own way
    common: dict[str, Any] = dict(
        name=name,
        format=entry.format,
        access="composite" if info is None else info.access,
        split=split,
        seed=seed,
        loading=loading,
        batch_size=batch_size,
        source=source.file,
        overrides=source.overrides,
        select=entry.select,
        record=entry.record.model_copy(
            update={"layout": entry.record.layout or (None if info is None else (info.layouts or (None,))[0])}
        ),
    )
    if info is None:
        return _resolve_mixture(catalog, name, entry, common, split, root, seed, batch_size, env, options, trail)
    section = None
    if info.options is not None and info.section is not None:
        section = info.options.model_validate(entry.section(info.section) or {})  # validated with the catalog
    location, from_holdout = _location(
        name,
        entry,
        split,
        loading,
        info.own_validation is not None and section is not None and info.own_validation(section),
    )
    train_shards = split == "train" or from_holdout
    base, storage_options = _base_url(location, source, root, env)
    names = [] if is_glob(location.shards) else shard_names(location)
    missing = _missing_names(location, names)
    key = manifest_key(entry.format, base, location.shards, tuple(sorted(missing)))
    # Only the catalog's own counts here; the storage layer adds those of the manifest cache.
    per_shard = (entry.totals.per_shard or {}) if train_shards else {}
    shards = [Shard(name=n, url=join_url(base, n), samples=per_shard.get(n)) for n in names if n not in missing]
    glob = join_url(base, str(location.shards)) if is_glob(location.shards) else None
    exact = bool(shards) and train_shards and all(s.samples is not None for s in shards)
    samples = (
        sum(s.samples or 0 for s in shards) if exact else (entry.totals.samples if train_shards else location.samples)
    )
    images = None
    if entry.embeddings is not None and entry.embeddings.images is not None:
        images = _resolve(
            catalog,
            catalog.canonical(entry.embeddings.images),
            split,
            root,
            seed,
            batch_size,
            env,
            options,
            (*trail, name),
        )
    return Plan(
        **common,
        root=base,
        shards=tuple(shards),
        missing=tuple(join_url(base, m) for m in names if m in missing),
        glob=glob,
        samples=samples,
        samples_exact=exact,
        bytes=entry.totals.bytes if train_shards else None,
        from_holdout=from_holdout,
        manifest=key,
        embeddings=entry.embeddings,
        options=section,
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
    env: Mapping[str, str] | None,
    options: Mapping[str, object],
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
            env,
            inherited,
            (*trail, name),
        )
        parts.append(PlanComponent(weight=1.0, plan=plan, declared_weight=component.weight))
    components = weigh_components(parts)
    sizes = [c.plan.bytes for c in components]
    return Plan(
        **common,
        root=root or "",
        components=components,
        exhaustion=entry.mixture.exhaustion,
        samples=mixture_samples(components, entry.totals.samples),
        samples_exact=all(c.plan.samples_exact for c in components),
        bytes=sum(b or 0 for b in sizes) if all(b is not None for b in sizes) else entry.totals.bytes,
    )


def override_loading(name: str, loading: Loading, options: Mapping[str, object]) -> Loading:
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


def _location(name: str, entry: Entry, split: str, loading: Loading, own_validation: bool) -> tuple[Location, bool]:
    """The location of ``split`` and whether it is the holdout at the head of the train shards."""
    assert entry.location is not None  # validated: every non-mixture format needs a location
    if split == "train":
        return entry.location, False
    if split in entry.splits:
        return entry.splits[split], False
    if split == "validation" and loading.val_split:
        return entry.splits[loading.val_split], False
    if split == "validation" and own_validation:
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
    return join_url(base, path) if path else base.rstrip("/"), storage_options


def join_url(base: str, name: str) -> str:
    """``name`` under ``base`` (a URL or a local folder); a name that would leave ``base`` is an OptionError."""
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
