"""Mixtures: components interleaved by weight, one epoch at a time, addressable by position.

Weights are sampling probabilities: at each position of the epoch a
component is drawn with probability proportional to its weight among those
that still have records. The exhaustion rule says when the epoch ends:

- ``stop_on_all``: a spent component drops out and the rest renormalise;
  the epoch is every record of every component, once.
- ``stop_on_first``: the epoch ends when the first component is spent (its
  length is drawn, and the same on every rank).
- ``restart``: a spent component starts its next permutation; the epoch is
  as long as all components together.

The draw sequence is one byte per position, generated from the seed and
epoch in each process that needs it (never pickled), with block prefix
counts so that "the k-th record of component c" is found in O(block).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from datacat.epochs import Schedule, epoch_key
from datacat.errors import OptionError
from datacat.pipeline import EpochView, Fetched, SampleSource, finish
from datacat.resolve import Plan
from datacat.schema import BadSamplePolicy
from datacat.transforms.captions import Tokenize
from datacat.transforms.ledger import Ledger

__all__ = ["MixtureSource", "MixtureView", "draw_sequence", "open_source"]

_BLOCK = 4096


def draw_sequence(sizes: Sequence[int], weights: Sequence[float], exhaustion: str, key: int) -> np.ndarray:
    """The component drawn at each position of one epoch (uint8), per the exhaustion rule."""
    if len(sizes) > 255:
        raise OptionError(f"a mixture of {len(sizes)} components is more than the 255 supported")
    rng = np.random.Generator(np.random.Philox(key=key))
    total = int(sum(sizes))
    weights_arr = np.asarray(weights, dtype=np.float64)
    if exhaustion == "restart":
        p = weights_arr / weights_arr.sum()
        return rng.choice(len(sizes), size=total, p=p).astype(np.uint8)
    remaining = np.asarray(sizes, dtype=np.int64)
    active = remaining > 0
    parts = []
    while active.any():
        p = np.where(active, weights_arr, 0.0)
        p /= p.sum()
        draws = rng.choice(len(sizes), size=int(remaining[active].sum()), p=p)
        # Keep the draws up to the first that would take a record a component no longer has.
        counts = np.zeros((len(draws), len(sizes)), dtype=np.int64) if len(sizes) * len(draws) < 2**24 else None
        if counts is not None:
            counts[np.arange(len(draws)), draws] = 1
            over = (np.cumsum(counts, axis=0) > remaining).any(axis=1)
        else:
            over = np.zeros(len(draws), dtype=bool)
            for c in range(len(sizes)):
                over |= np.cumsum(draws == c) > remaining[c]
        stop = int(np.argmax(over)) if over.any() else len(draws)
        taken = draws[:stop]
        parts.append(taken.astype(np.uint8))
        remaining -= np.bincount(taken, minlength=len(sizes))
        if exhaustion == "stop_on_first" and stop < len(draws):
            break
        active = remaining > 0
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


class MixtureSource:
    """The components' SampleSources and the mixture's one ledger."""

    def __init__(
        self,
        plan: Plan,
        *,
        tokenize: Tokenize | None = None,
        on_bad_sample: BadSamplePolicy | None = None,
        bad_sample_budget: float | None = None,
    ) -> None:
        if any(c.plan.format == "mixture" for c in plan.components):
            raise OptionError(
                f"{plan.name}: a mixture of mixtures is not supported yet; list their components in one mixture"
            )
        self.plan = plan
        self.components = [
            SampleSource(c.plan, tokenize=tokenize, on_bad_sample=on_bad_sample, bad_sample_budget=bad_sample_budget)
            for c in plan.components
        ]
        sizes = {c.plan.loading.image_size for c in plan.components}
        if len(sizes) > 1:
            raise OptionError(
                f"{plan.name}: its components resolve to different image sizes {sorted(sizes)}; pass image_size="
            )
        self.weights = tuple(c.weight for c in plan.components)
        self.exhaustion = plan.exhaustion or "stop_on_all"
        self.ledger = Ledger.for_plan(plan, policy=on_bad_sample, budget=bad_sample_budget)
        self.sizes = tuple(len(c) for c in self.components)

    def __repr__(self) -> str:
        parts = ", ".join(f"{c.plan.name} x{w:.3f}" for c, w in zip(self.components, self.weights, strict=True))
        return f"MixtureSource({self.plan.name!r}: {parts}; {self.exhaustion})"

    @property
    def random_access(self) -> bool:
        return all(c.random_access for c in self.components)

    def epoch_length(self, seed: int, epoch: int) -> int:
        """Records in one epoch (only ``stop_on_first`` makes it vary by epoch)."""
        if self.exhaustion != "stop_on_first":
            return sum(self.sizes)
        return len(_draws(self.sizes, self.weights, self.exhaustion, epoch_key(seed, epoch, "mixture"))[0])

    def __len__(self) -> int:
        return sum(self.sizes)

    def view(self, schedule: Schedule, *, seed: int, epoch: int, shuffle: bool) -> MixtureView:
        """One rank's records of one epoch, by index."""
        return MixtureView(self, schedule, seed=seed, epoch=epoch, shuffle=shuffle)


@functools.lru_cache(maxsize=4)
def _draws(
    sizes: tuple[int, ...], weights: tuple[float, ...], exhaustion: str, key: int
) -> tuple[np.ndarray, np.ndarray]:
    sequence = draw_sequence(sizes, weights, exhaustion, key)
    # prefix[b, c]: how many of the first b * _BLOCK draws went to component c.
    blocks = -(-len(sequence) // _BLOCK)
    prefix = np.zeros((blocks + 1, len(sizes)), dtype=np.int64)
    for b in range(blocks):
        prefix[b + 1] = prefix[b] + np.bincount(sequence[b * _BLOCK : (b + 1) * _BLOCK], minlength=len(sizes))
    return sequence, prefix


class MixtureView:
    """One rank's records of one epoch of a mixture, by index; the same contract as ``EpochView``."""

    def __init__(self, source: MixtureSource, schedule: Schedule, *, seed: int, epoch: int, shuffle: bool) -> None:
        self.source = source
        self.schedule = schedule
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.key = epoch_key(seed, epoch, "mixture")
        self._views: dict[tuple[int, int], EpochView] = {}

    def __len__(self) -> int:
        return self.schedule.stop - self.schedule.start

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_views": {}}

    def __repr__(self) -> str:
        return f"MixtureView({self.source.plan.name!r}, epoch={self.epoch}, records {self.schedule.start}..{self.schedule.stop})"

    @property
    def image_size(self) -> int:
        return self.source.components[0].plan.loading.image_size

    def locate(self, index: int) -> tuple[int, int]:
        """(component, k): the record at ``index`` is the k-th draw of that component this epoch."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        sequence, prefix = _draws(self.source.sizes, self.source.weights, self.source.exhaustion, self.key)
        j = self.schedule.start + index
        component = int(sequence[j])
        block = j // _BLOCK
        k = int(prefix[block, component]) + int(np.count_nonzero(sequence[block * _BLOCK : j] == component))
        return component, k

    def _component_view(self, component: int, round_: int) -> EpochView:
        key = (component, round_)
        if key not in self._views:
            source = self.source.components[component]
            whole = Schedule(len(source), 0, len(source), (len(source),))
            # A component's own epoch: the mixture's, or later ones as ``restart`` starts it over.
            seed = epoch_key(self.seed, component, "component")
            self._views[key] = EpochView(
                source, whole, seed=seed, epoch=self.epoch * 1000 + round_, shuffle=self.shuffle
            )
            if len(self._views) > 2 * len(self.source.components):
                self._views.pop(next(iter(self._views)))
        return self._views[key]

    @property
    def random_access(self) -> bool:
        return self.source.random_access

    def fetch(self, indices: Sequence[int]) -> list[Fetched]:
        """The raw records at ``indices``, each component's read at once."""
        wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for slot, index in enumerate(indices):
            component, k = self.locate(index)
            size = self.source.sizes[component]
            wanted.setdefault((component, k // size), []).append((slot, k % size))
        out: list[Fetched | None] = [None] * len(indices)
        for (component, round_), pairs in wanted.items():
            view = self._component_view(component, round_)
            for (slot, _), fetched in zip(pairs, view.fetch([k for _, k in pairs]), strict=True):
                out[slot] = fetched
        return [f for f in out if f is not None]

    def finish(self, fetched: Sequence[Fetched]) -> list[dict[str, Any]]:
        """Samples (or markers) of fetched records, each naming its component."""
        return finish(fetched, component=True)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.finish(self.fetch([index]))[0]


def open_source(
    plan: Plan,
    *,
    tokenize: Tokenize | None = None,
    on_bad_sample: BadSamplePolicy | None = None,
    bad_sample_budget: float | None = None,
) -> SampleSource | MixtureSource:
    """The source of a Plan's samples: a MixtureSource for a mixture, else a SampleSource."""
    kind = MixtureSource if plan.format == "mixture" else SampleSource
    return kind(plan, tokenize=tokenize, on_bad_sample=on_bad_sample, bad_sample_budget=bad_sample_budget)
