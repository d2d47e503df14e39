"""The public ``resolve``: an entry's Plan as the catalog gives it, completed from storage."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Unpack

from datacat.catalog import Catalog, load_catalog
from datacat.plan import Plan
from datacat.resolve import LoadingOverrides, resolve_entry
from datacat.storage.plans import complete_plan

__all__ = ["resolve"]


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
    **loading: Unpack[LoadingOverrides],
) -> Plan:
    """The Plan for one split of a catalog entry.

    Record counts the catalog does not declare come from the manifest cache,
    and a glob's shards from its manifest or from listing it.

    Args:
        name: An entry name or alias, in any case.
        split: ``"train"`` (the entry's ``location``) or a name under its ``splits``.
        root: Replaces the entry's root (and its components'); default ``$DATACAT_ROOT`` where the entry uses it.
        seed: The seed every shuffle and augmentation derives from.
        batch_size: Needed to turn ``val_batches`` into a number of held-out records.
        catalog: The catalog to look in; default the built-in one plus ``$DATACAT_CATALOG``.
        list_shards: List glob shard specs now and read img2dataset's per-shard stats (may touch storage);
            otherwise the Plan keeps the glob, and shards without a declared count stay uncounted.
        env: Where ``${VAR}`` in the entry is looked up; default the environment.
        loading: Overrides of the entry's ``loading`` section, e.g. ``image_size=256``.

    Example:
        >>> plan = datacat.resolve("cc3m", root="/data/msml612")
        >>> len(plan.shards)
        49
    """
    catalog = load_catalog() if catalog is None else catalog
    plan = resolve_entry(
        name, catalog=catalog, split=split, root=root, seed=seed, batch_size=batch_size, env=env, loading=loading
    )
    return complete_plan(plan, list_shards=list_shards)
