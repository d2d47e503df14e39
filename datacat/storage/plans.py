"""Completing a Plan from storage: its globs listed and its record counts read from the manifest cache."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from datacat.errors import ShardError
from datacat.plan import Plan, Shard, mixture_samples, weigh_components
from datacat.shards import beside
from datacat.storage.files import read_many
from datacat.storage.listing import list_glob
from datacat.storage.manifests import load_manifest

__all__ = ["complete_plan"]


def complete_plan(plan: Plan, *, list_shards: bool = True) -> Plan:
    """``plan`` with what storage knows added: mixture components and an embeddings entry's images alike.

    A glob is replaced by the shards its manifest names (no listing), else,
    with ``list_shards``, by listing it; a shard the catalog gives no count
    takes its manifest's, or (``list_shards``, an entry joining img2dataset's
    parquet) the count in the stats file beside it. The totals follow from the counts as in
    :mod:`datacat.resolve`; the catalog's own counts win over the manifest's.
    """
    if plan.components:
        return _complete_mixture(plan, list_shards)
    manifest = load_manifest(plan.manifest) if plan.manifest else None
    shards, glob = plan.shards, plan.glob
    declared = {s.name for s in plan.shards if s.samples is not None}
    if glob is not None:
        if manifest is not None:  # listed before: the manifest's shards, no listing now
            shards = tuple(Shard(name=f.name, url=f.url, samples=f.records) for f in manifest.shards.values())
            glob = None
        elif list_shards:
            shards = tuple(list_glob(glob, plan.storage_options))
            glob = None
    elif manifest is not None:
        known = {n: f.records for n, f in manifest.shards.items()}
        shards = tuple(
            s if s.samples is not None else s.model_copy(update={"samples": known.get(s.name)}) for s in shards
        )
    if list_shards and plan.record.metadata == "parquet" and glob is None and any(s.samples is None for s in shards):
        shards = _counted_by_stats(shards, plan.storage_options)
    exact = bool(shards) and (plan.split == "train" or plan.from_holdout) and all(s.samples is not None for s in shards)
    images = complete_plan(plan.images, list_shards=list_shards) if plan.images is not None else None
    return plan.model_copy(
        update={
            "shards": shards,
            "glob": glob,
            "samples": sum(s.samples or 0 for s in shards) if exact else plan.samples,
            "samples_exact": exact,
            "samples_counted": exact and any(s.name not in declared for s in shards),
            "images": images,
        }
    )


def _counted_by_stats(shards: Sequence[Shard], storage_options: dict[str, Any]) -> tuple[Shard, ...]:
    """Shards without a count take img2dataset's: the ``successes`` of the ``NNNNN_stats.json`` beside each.

    Read concurrently, no shard opened; a shard without a stats file stays
    uncounted (the loader counts it when it indexes the tar).
    """
    todo = [i for i, s in enumerate(shards) if s.samples is None]
    urls = [beside(shards[i].url, "_stats.json") for i in todo]
    out = list(shards)
    for i, url, data in zip(todo, urls, read_many(urls, storage_options), strict=True):
        if isinstance(data, Exception):
            continue
        try:
            successes = json.loads(data)["successes"]
            if not isinstance(successes, int) or successes < 0:
                raise TypeError(f"'successes' is {successes!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise ShardError(
                f"{url} is not img2dataset's stats of {shards[i].name} (no count of successes: {exc}); "
                "fix or delete it, or declare totals.per_shard",
                url=url,
            ) from None
        out[i] = shards[i].model_copy(update={"samples": successes})
    return tuple(out)


def _complete_mixture(plan: Plan, list_shards: bool) -> Plan:
    parts = [c.model_copy(update={"plan": complete_plan(c.plan, list_shards=list_shards)}) for c in plan.components]
    components = weigh_components(parts)
    return plan.model_copy(
        update={
            "components": components,
            # Some count unknown: the plan's own samples, which are then what the mixture declares.
            "samples": mixture_samples(components, plan.samples),
            "samples_exact": all(c.plan.samples_exact for c in components),
        }
    )
