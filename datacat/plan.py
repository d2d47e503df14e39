"""The Plan: everything a backend needs to load one split of one entry, as frozen, framework-free data.

A Plan holds the concrete shard URLs in a stable order with missing shards
left out, the record layout, the transform settings, normalised mixture
weights and the record counts where they are known. It does no I/O:
:mod:`datacat.resolve` makes one from an entry, the storage layer completes
it (globs listed, counts from the manifest cache); ``describe`` prints it,
backends consume it, and its fingerprint identifies it in a saved loader state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny

from datacat.schema import Condition, Embeddings, Exhaustion, Loading, Record

__all__ = ["Plan", "PlanComponent", "Shard", "ShardFacts", "manifest_key", "mixture_samples", "weigh_components"]


@dataclasses.dataclass
class ShardFacts:
    """One shard as last read: its records and bytes, a checksum if verified, its tar index file if any."""

    name: str
    records: int
    url: str = ""
    bytes: int | None = None
    checksum: str | None = None
    index: str | None = None
    """File name (under the cache dir's ``tar-index``) of the shard's sample spans, int64 [records, 2]."""
    compressed: bool = False


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
    declared_weight: float | None = None
    """The weight the catalog gives, before normalising; None: weighted by the component's records."""


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
    """A glob of shard URLs not yet listed (a pure Plan, or ``resolve(list_shards=False)``)."""
    samples: int | None = None
    samples_exact: bool = False
    samples_counted: bool = False
    """Some shard's count came from reading it (the manifest cache), not from the catalog."""
    bytes: int | None = None
    record: Record = Record()
    select: dict[str, Condition] = {}
    """The entry's metadata bounds: the records read are those that meet them."""
    loading: Loading = Loading()
    batch_size: int | None = None
    components: tuple[PlanComponent, ...] = ()
    exhaustion: Exhaustion | None = None
    embeddings: Embeddings | None = None
    options: SerializeAsAny[BaseModel] | None = None
    """The format's own section, validated by the options model it declares (None: it has none)."""
    images: Plan | None = None
    """For an embeddings entry: the plan of the image shards it aligns with."""
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False, exclude=True)
    storage_options_shown: dict[str, Any] = {}
    """storage_options as the catalog writes them (``${VAR}`` unexpanded, literal secrets redacted)."""
    source: str = ""
    overrides: tuple[str, ...] = ()

    manifest: str = ""
    """The key of this shard set's manifest in the cache (see :mod:`datacat.storage.manifests`)."""
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
                "batch_size",
            },
        )
        # The batch size decides the stream only through the holdout it sets (elastic resume may change it).
        data["holdout_records"] = self.holdout_records
        data["shards"] = [(s["name"], s["url"]) for s in data["shards"]]
        data["components"] = [(c.weight, c.plan._identity()) for c in self.components]
        data["images"] = self.images._identity() if self.images is not None else None
        return data


def manifest_key(fmt: str, base: str, shards: str | tuple[str, ...], missing: tuple[str, ...]) -> str:
    """The key of a shard set's manifest: what names its files, nothing of how it is loaded."""
    identity = json.dumps([fmt, base, shards, sorted(missing)], sort_keys=True)
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def weigh_components(components: Sequence[PlanComponent]) -> tuple[PlanComponent, ...]:
    """``components`` with weights normalised: the declared weight, else the component's record count."""
    weights = [c.declared_weight if c.declared_weight is not None else float(c.plan.samples or 0) for c in components]
    total = sum(weights)
    return tuple(c.model_copy(update={"weight": w / total}) for c, w in zip(components, weights, strict=True))


def mixture_samples(components: tuple[PlanComponent, ...], declared: int | None) -> int | None:
    """A mixture's records: its components' sum where every one is known, else what the mixture declares."""
    counts = [c.plan.samples for c in components]
    return sum(c or 0 for c in counts) if all(c is not None for c in counts) else declared


PlanComponent.model_rebuild()
Plan.model_rebuild()
