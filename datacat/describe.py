"""What ``datacat describe`` reports: the Plan, the entry's facts, and the on-disk contract.

Plain data only, so the CLI can print it as text or JSON and tests can read
it; nothing here opens a shard.
"""

from __future__ import annotations

from typing import Any

from datacat.catalog import Catalog, load_catalog
from datacat.formats.selection import selected_count
from datacat.plan import Plan
from datacat.planning import resolve
from datacat.registry import MIXTURE, format_of
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

    Globs are listed, and img2dataset's stats files read, only for local roots, so describing a bucket entry
    needs no network.

    Example:
        >>> datacat.describe("cc3m")["shard_count"]
        49
    """
    catalog = load_catalog() if catalog is None else catalog
    canonical = catalog.canonical(name)
    entry = catalog[canonical]
    probe = resolve(canonical, catalog=catalog, split=split, root=root, list_shards=False)
    where = probe.glob if probe.glob is not None else (probe.shards[0].url if probe.shards else "")
    local = bool(where) and "://" not in where  # a local entry's globs are listed and its stats files read
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
        "selected": selected_count(plan) if plan.select else None,
        "fingerprint": plan.fingerprint(),
        "plan": plan.to_json(),
    }


def _pattern(entry: Entry) -> Any:
    return None if entry.location is None else _pattern_of(entry.location.shards)


def _pattern_of(shards: str | tuple[str, ...]) -> Any:
    return list(shards) if isinstance(shards, tuple) else shards


def layout_contract(plan: Plan, entry: Entry | None = None) -> list[str]:
    """The rules files must follow for this entry to load, one sentence each."""
    if plan.format == MIXTURE:  # its components' files
        return [f"Each component ({', '.join(c.plan.name for c in plan.components)}) follows its own contract."]
    declared = format_of(plan.format)
    lines = []
    if entry is not None and entry.location is not None and not is_glob(entry.location.shards):
        lines.append(f"Every shard the pattern names, except the missing ones, exists under {plan.root}.")
    else:
        lines.append(f"Shards are every file matching {plan.glob or plan.root + '/<shard>'}, read in sorted order.")
    return lines + declared.contract(plan)
