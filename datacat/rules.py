"""The rules a catalog must keep beyond its schema, each reported with its key path.

``check_entry`` relates one entry's fields to each other (missing shards
inside the pattern, declared shard count, layout fitting the format);
``check_catalog`` relates entries (mixture components exist, no cycles,
aliases unique). Each yields ``(name, key path, message)`` so the caller can
add the file and line and report every problem at once.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Iterator, Mapping

from pydantic import ValidationError

from datacat.interpolate import unset_variables
from datacat.registry import MIXTURE, Format, format_names, format_of
from datacat.schema import Entry, Location
from datacat.shards import brace_numbers, expand_braces

__all__ = ["check_catalog", "check_entry", "escapes_root", "is_glob", "shard_names"]

Finding = tuple[str, tuple[str | int, ...], str]
_GLOB = re.compile(r"[*?\[]")


def is_glob(shards: str | tuple[str, ...]) -> bool:
    """Whether a shard spec is a glob, listed from storage when the entry is loaded."""
    return isinstance(shards, str) and bool(_GLOB.search(shards))


def shard_names(location: Location) -> list[str]:
    """The shard names a location's pattern or list denotes, before removing missing ones."""
    if isinstance(location.shards, tuple):
        return list(location.shards)
    return expand_braces(location.shards)


def check_entry(name: str, entry: Entry, env: Mapping[str, str] | None = None) -> Iterator[Finding]:
    """Every rule one entry breaks on its own."""
    known = format_names()
    if entry.format == MIXTURE:
        yield from _check_mixture(name, entry)
        yield from _check_extra(name, entry, None)
        return
    if entry.format not in known:
        close = difflib.get_close_matches(entry.format, [*known, MIXTURE], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        yield name, ("format",), f"{entry.format!r} is not a known format (known: {', '.join(known)}){hint}"
        return
    info = format_of(entry.format)
    # A misspelt key is both unknown and, for the key it meant, missing: say it once, with the fix.
    meant = {m for key in entry.model_extra or {} for m in difflib.get_close_matches(key, Entry.model_fields, n=1)}
    for section in info.needs:
        if getattr(entry, section, None) is None and section not in meant:
            yield name, (section,), f"required for format {entry.format!r}"
    if entry.mixture is not None:
        yield name, ("mixture",), f"only a {MIXTURE!r} entry has this section, this one has format {entry.format!r}"
    for section in _SCHEMA_SECTIONS:  # a schema section only some formats read, on an entry of another
        if section not in info.sections and section not in info.needs and getattr(entry, section) is not None:
            yield name, (section,), _not_mine(section, entry.format)
    yield from _check_extra(name, entry, info)
    if info.layouts and entry.record.layout is not None and entry.record.layout not in info.layouts:
        yield (
            name,
            ("record", "layout"),
            (
                f"{entry.record.layout!r} is not a layout of format {entry.format!r} (use one of {', '.join(info.layouts)})"
            ),
        )
    if entry.record.fields and not info.fields:
        yield name, ("record", "fields"), f"format {entry.format!r} does not pass record fields through; remove them"
    if entry.loading.buckets is not None and entry.record.metadata is None:
        yield (
            name,
            ("loading", "buckets"),
            "needs each image's size: set record.metadata (parquet, its width and height)",
        )
    if entry.select and entry.record.metadata is None:
        yield name, ("select",), "bounds metadata columns: set record.metadata (parquet) to say which table holds them"
    if entry.record.metadata is not None and entry.record.metadata not in info.metadata:
        tables = f"only {', '.join(info.metadata)}" if info.metadata else "none"
        yield name, ("record", "metadata"), f"format {entry.format!r} joins {tables}, not {entry.record.metadata!r}"
    if entry.location is not None:
        yield from _check_location(name, ("location",), entry.location, entry, env)
    for split, location in entry.splits.items():
        yield from _check_location(name, ("splits", split), location, None, env)
    if entry.loading.val_split is not None and entry.loading.val_split not in entry.splits:
        known_splits = ", ".join(entry.splits) or "none declared"
        yield name, ("loading", "val_split"), f"{entry.loading.val_split!r} is not under splits ({known_splits})"


_SCHEMA_SECTIONS = ("embeddings",)
"""Sections of the schema (not of a format) that only the formats naming them in ``needs`` or ``sections`` read."""


def _check_mixture(name: str, entry: Entry) -> Iterator[Finding]:
    if entry.mixture is None:
        yield name, ("mixture",), f"required for format {MIXTURE!r}"
    if entry.location is not None:
        yield name, ("location",), "a mixture has no shards of its own; remove it and list components"
    if entry.select:
        yield name, ("select",), "a mixture selects through its components: put select on each component's entry"
    for section in _SCHEMA_SECTIONS:
        if getattr(entry, section) is not None:
            yield name, (section,), _not_mine(section, MIXTURE)


def _owners(section: str) -> list[str]:
    """The formats that read ``section`` (imports every format's module: only asked for a misplaced section)."""
    found = []
    for known in format_names():
        info = format_of(known)
        if section in (*info.needs, *info.sections, info.section):
            found.append(known)
    return found


def _not_mine(section: str, format_name: str) -> str:
    owners = " or ".join(repr(o) for o in _owners(section))
    return f"only a {owners} entry has this section, this one has format {format_name!r}"


def _check_extra(name: str, entry: Entry, info: Format | None) -> Iterator[Finding]:
    """The keys beyond the schema's: the format's own section, validated by its options model; any other is refused."""
    extra = dict(entry.model_extra or {})
    own = info.section if info is not None else None
    if info is not None and info.options is not None and own is not None:
        try:
            info.options.model_validate(extra.pop(own, None) or {})
        except ValidationError as exc:
            for err in exc.errors():
                loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and "[" in p))
                if err["type"] == "missing" and own not in (entry.model_extra or {}):
                    yield name, (own,), f"required for format {entry.format!r} (its {own}.{loc[-1]} at least)"
                    break
                message = {
                    "missing": "required key is missing",
                    "extra_forbidden": f"unknown key of {own}; see the reference of format {entry.format!r}",
                }.get(err["type"], f"{err['msg']} (got {err.get('input')!r})")
                yield name, (own, *loc), message
    for key in extra:
        if _owners(key):
            yield name, (key,), _not_mine(key, entry.format)
            continue
        meant = difflib.get_close_matches(key, [*Entry.model_fields, *([own] if own else [])], n=1)
        hint = f"did you mean {meant[0]!r}?" if meant else "see `datacat schema` for the keys an entry may have"
        yield name, (key,), f"unknown key; {hint}"


def escapes_root(name: str) -> bool:
    """Whether a shard name or path would resolve outside its root: absolute, a URL, ``~`` or a ``..`` part."""
    if "/" not in name and "\\" not in name and not name.startswith("~"):
        return name == ".."  # a plain file name (nearly every shard): nothing to climb out with
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "~")) or "://" in name or ".." in parts


def _check_location(
    name: str, at: tuple[str | int, ...], location: Location, entry: Entry | None, env: Mapping[str, str] | None
) -> Iterator[Finding]:
    for path, var in unset_variables(location.model_dump(include={"root", "path", "storage_options"}), env):
        yield name, (*at, *path), f"${{{var}}} is not set and has no default; export {var} or write ${{{var}:-default}}"
    if location.path and "${" not in location.path and escapes_root(location.path):
        yield name, (*at, "path"), f"{location.path!r} leaves the root; path is a folder inside the root"
    if is_glob(location.shards):
        if location.missing:
            yield name, (*at, "missing"), "a glob lists only shards that exist; declare missing shards with a pattern"
        pattern = str(location.shards)
        if entry is not None and not format_of(entry.format).names_a_shard(pattern):
            yield (
                name,
                (*at, "shards"),
                f"{pattern!r} matches no shard of format {entry.format!r}: {format_of(entry.format).shards_are}",
            )
        return
    try:
        names = shard_names(location)
    except ValueError as exc:
        yield name, (*at, "shards"), str(exc)
        return
    named = set(names)
    if len(named) != len(names):
        yield name, (*at, "shards"), "names some shard twice"
    if entry is not None:
        declared = format_of(entry.format)
        wrong = next((n for n in names if not declared.names_a_shard(n)), None)
        if wrong is not None:
            yield name, (*at, "shards"), f"{wrong!r} is not a shard of format {entry.format!r}: {declared.shards_are}"
    outside = next((n for n in names if escapes_root(n)), None)
    if outside is not None:
        yield name, (*at, "shards"), f"shard name {outside!r} leaves the root; a shard name is a path inside the root"
    numbers = brace_numbers(location.shards) if isinstance(location.shards, str) else None
    missing: set[str] = set()
    for i, item in enumerate(location.missing):
        if isinstance(item, int):
            if numbers is None:
                yield (
                    name,
                    (*at, "missing", i),
                    f"{item} is a number but shards is not a single {{lo..hi}} range; name the shard",
                )
            elif item not in numbers:
                yield name, (*at, "missing", i), f"{item} is outside {numbers.start}..{numbers.stop - 1}"
            else:
                missing.add(names[numbers.index(item)])
        elif item not in named:
            yield name, (*at, "missing", i), f"{item!r} is not a shard the pattern names"
        else:
            missing.add(item)
    if entry is None:
        return
    present = named - missing
    totals = entry.totals
    if totals.shards is not None and totals.shards != len(present):
        yield (
            name,
            ("totals", "shards"),
            (
                f"{totals.shards} declared, but the pattern names {len(names)} shards less {len(missing)} missing = {len(present)}"
            ),
        )
    if totals.per_shard is not None:
        for shard in totals.per_shard:
            if shard not in present:
                why = "is declared missing" if shard in missing else "is not a shard the pattern names"
                yield name, ("totals", "per_shard", shard), f"{shard!r} {why}"
        if totals.samples is not None and set(totals.per_shard) == present:
            counted = sum(totals.per_shard.values())
            if counted != totals.samples:
                yield name, ("totals", "samples"), f"{totals.samples} declared, but per_shard adds up to {counted}"


def check_catalog(entries: Mapping[str, Entry], *, also_known: Iterable[str] = ()) -> Iterator[Finding]:
    """Every rule the entries break together: references, cycles, aliases.

    ``also_known`` names entries that exist but failed their schema, so that
    references to them are not reported a second time.
    """
    owner: dict[str, str] = {}
    for name in entries:
        owner[name.casefold()] = name
    known = {n.casefold() for n in also_known} - set(owner)
    for name, entry in entries.items():
        for i, alias in enumerate(entry.aliases):
            folded = alias.casefold()
            if folded in owner and owner[folded] != name:
                yield name, ("aliases", i), f"{alias!r} is already the name or an alias of {owner[folded]!r}"
            else:
                owner[folded] = name
    for name, entry in entries.items():
        if entry.mixture is not None:
            for i, component in enumerate(entry.mixture.components):
                target = owner.get(component.name.casefold())
                if target is None and component.name.casefold() in known:
                    continue
                if target is None:
                    yield name, ("mixture", "components", i, "name"), _unknown(component.name, owner)
                elif component.weight is None and entries[target].totals.samples is None:
                    yield (
                        name,
                        ("mixture", "components", i, "weight"),
                        (f"{component.name!r} declares no totals.samples to weight by; give a weight"),
                    )
        images = entry.embeddings.images if entry.embeddings is not None else None
        if images is not None and images.casefold() not in owner and images.casefold() not in known:
            yield name, ("embeddings", "images"), _unknown(images, owner)
    yield from _check_cycles(entries, owner)


def _unknown(ref: str, owner: Mapping[str, str]) -> str:
    close = difflib.get_close_matches(ref.casefold(), owner, n=1)
    hint = f"; did you mean {owner[close[0]]!r}?" if close else ""
    return f"{ref!r} is not an entry of the catalog{hint}"


def _check_cycles(entries: Mapping[str, Entry], owner: Mapping[str, str]) -> Iterator[Finding]:
    def children(name: str) -> list[str]:
        mixture = entries[name].mixture
        if mixture is None:
            return []
        return [owner[c.name.casefold()] for c in mixture.components if c.name.casefold() in owner]

    reported: set[frozenset[str]] = set()
    for start in entries:
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack:
            node, trail = stack.pop()
            for child in children(node):
                if child == start:
                    cycle = frozenset(trail)
                    if cycle not in reported:
                        reported.add(cycle)
                        yield start, ("mixture", "components"), f"cycle: {' -> '.join([*trail, start])}"
                elif child not in trail:
                    stack.append((child, [*trail, child]))
