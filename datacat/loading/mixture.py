"""The mixture, a composite source: components interleaved by weight, one epoch at a time, addressable by position.

Weights are sampling probabilities: at each position of the epoch a
component is drawn with probability proportional to its weight among those
that still have records. The exhaustion rule says when the epoch ends:

- ``stop_on_all``: a spent component drops out and the rest renormalise;
  the epoch is every record of every component, once.
- ``stop_on_first``: the epoch ends when the first component is spent (its
  length is drawn, and the same on every rank).
- ``restart``: a spent component starts its next permutation; the epoch is
  as long as all components together.

The draws are made by blocks (:class:`Draws`): each block's counts per
component for the whole epoch at once, the order inside a block only for
the blocks a process reads, all from the seed and epoch, so "the k-th
record of component c" is found in O(block) and a rank's start-up costs
O(its share) however long the epoch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from datacat.errors import OptionError
from datacat.loading.epochs import Schedule
from datacat.loading.options import LoadOptions
from datacat.loading.shuffle import epoch_key
from datacat.loading.sources import EpochView, Fetched, SampleSource, finish, ledger_for, reads_remote
from datacat.plan import Plan

__all__ = ["Draws", "MixtureSource", "MixtureView", "open_source"]

_BLOCK = 4096


class Draws:
    """The component drawn at each position of one epoch, per the exhaustion rule, made block by block.

    An epoch is cut into blocks of ``_BLOCK`` positions. How many draws of
    each component a block holds comes first, for all blocks at once
    (multinomial by weight among the components that still have records,
    a few vectorised passes: O(blocks x components), ~7k rows for 30M
    records); the order inside a block is a shuffle of its counts keyed by
    the block, made only for the blocks a process reads. So a rank's start
    costs O(its share), not O(the epoch), and every process agrees.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], exhaustion: str, key: int) -> None:
        if len(sizes) > 255:
            raise OptionError(f"a mixture of {len(sizes)} components is more than the 255 supported")
        self.key = key
        self.components = len(sizes)
        rng = np.random.Generator(np.random.Philox(key=key))
        size = np.asarray(sizes, dtype=np.int64)
        weight = np.asarray(weights, dtype=np.float64)
        total = int(size.sum())
        blocks = max(1, -(-total // _BLOCK))
        lengths = np.full(blocks, _BLOCK, dtype=np.int64)
        lengths[-1] = total - _BLOCK * (blocks - 1)
        self._cut: tuple[int, int, np.ndarray] | None = None
        if exhaustion == "restart":
            counts = rng.multinomial(lengths, weight / weight.sum())
        elif exhaustion == "stop_on_first":
            counts = rng.multinomial(lengths, weight / weight.sum())
            over = (np.cumsum(counts, axis=0) > size).any(axis=1)
            if over.any():
                last = int(np.argmax(over))
                before = counts[:last].sum(axis=0)
                order = self._shuffled(last, counts[last])
                taken = np.cumsum(np.eye(self.components, dtype=np.int64)[order], axis=0) + before
                stop = int(np.argmax((taken > size).any(axis=1)))
                self._cut = (last, stop, counts[last].copy())
                counts = counts[: last + 1].copy()
                counts[last] = np.bincount(order[:stop], minlength=self.components)
                lengths = lengths[: last + 1].copy()
                lengths[last] = stop
        else:  # stop_on_all: a spent component drops out, the rest renormalise
            counts = np.zeros((blocks, self.components), dtype=np.int64)
            remaining = size.copy()
            i = 0
            while i < blocks:
                p = np.where(remaining > 0, weight, 0.0)
                drawn = rng.multinomial(lengths[i:], p / p.sum())
                over = (np.cumsum(drawn, axis=0) > remaining).any(axis=1)
                fit = int(np.argmax(over)) if over.any() else len(drawn)
                counts[i : i + fit] = drawn[:fit]
                remaining -= drawn[:fit].sum(axis=0)
                i += fit
                if i < blocks:  # block i would overdraw a component: fill it within what is left
                    counts[i] = _fill(int(lengths[i]), remaining, weight, rng)
                    remaining -= counts[i]
                    i += 1
        self.counts = counts
        self.prefix = np.vstack([np.zeros((1, self.components), np.int64), np.cumsum(counts, axis=0)])
        self.length = int(lengths.sum())
        self._blocks: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.length

    def _shuffled(self, block: int, counts: np.ndarray) -> np.ndarray:
        order = np.repeat(np.arange(self.components, dtype=np.uint8), counts)
        np.random.Generator(np.random.Philox(key=self.key ^ ((block + 1) * 0x9E3779B97F4A7C15 & (2**64 - 1)))).shuffle(
            order
        )
        return order

    def block(self, b: int) -> np.ndarray:
        """The components drawn in block ``b``, in order."""
        found = self._blocks.get(b)
        if found is None:
            if self._cut is not None and b == self._cut[0]:
                found = self._shuffled(b, self._cut[2])[: self._cut[1]]
            else:
                found = self._shuffled(b, self.counts[b])
            if len(self._blocks) >= 8:
                self._blocks.pop(next(iter(self._blocks)))
            self._blocks[b] = found
        return found

    def locate(self, j: int) -> tuple[int, int]:
        """(component, k): position ``j`` of the epoch is the k-th draw of that component."""
        b, offset = divmod(j, _BLOCK)
        order = self.block(b)
        component = int(order[offset])
        return component, int(self.prefix[b, component]) + int(np.count_nonzero(order[:offset] == component))


def _fill(n: int, remaining: np.ndarray, weight: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``n`` draws by weight, none beyond a component's ``remaining`` records (their total is at least n)."""
    counts = np.zeros(len(remaining), dtype=np.int64)
    while (left := n - int(counts.sum())) > 0:
        room = remaining - counts
        p = np.where(room > 0, weight, 0.0)
        counts += np.minimum(rng.multinomial(left, p / p.sum()), room)
    return counts


class MixtureSource:
    """The components' SampleSources and the mixture's one ledger."""

    def __init__(self, plan: Plan, options: LoadOptions | None = None) -> None:
        if any(c.plan.format == "mixture" for c in plan.components):
            raise OptionError(
                f"{plan.name}: a mixture of mixtures is not supported yet; list their components in one mixture"
            )
        if any(c.plan.loading.buckets is not None for c in plan.components):
            raise OptionError(
                f"{plan.name}: a mixture draws each record from a component, so its batches cannot keep to one "
                "aspect-ratio bucket; drop loading.buckets from its components"
            )
        self.plan = plan
        self.bucketing = None  # a mixture's batches are squares
        self.components = [SampleSource(c.plan, options) for c in plan.components]
        sizes = {c.plan.loading.image_size for c in plan.components}
        if len(sizes) > 1:
            raise OptionError(
                f"{plan.name}: its components resolve to different image sizes {sorted(sizes)}; pass image_size="
            )
        self.weights = tuple(c.weight for c in plan.components)
        self.exhaustion = plan.exhaustion or "stop_on_all"
        self.ledger = ledger_for(plan, options)
        self.sizes = tuple(len(c) for c in self.components)

    def __repr__(self) -> str:
        parts = ", ".join(f"{c.plan.name} x{w:.3f}" for c, w in zip(self.components, self.weights, strict=True))
        return f"MixtureSource({self.plan.name!r}: {parts}; {self.exhaustion})"

    @property
    def random_access(self) -> bool:
        return all(c.random_access for c in self.components)

    @property
    def remote(self) -> bool:
        """Whether any component's shards are in remote storage."""
        return reads_remote(self.plan)

    def epoch_length(self, seed: int, epoch: int) -> int:
        """Records in one epoch (only ``stop_on_first`` makes it vary by epoch)."""
        if self.exhaustion != "stop_on_first":
            return sum(self.sizes)
        return len(_draws(self.sizes, self.weights, self.exhaustion, epoch_key(seed, epoch, "mixture")))

    def __len__(self) -> int:
        return sum(self.sizes)

    def view(self, schedule: Schedule, *, seed: int, epoch: int, shuffle: int) -> MixtureView:
        """One rank's records of one epoch, by index."""
        return MixtureView(self, schedule, seed=seed, epoch=epoch, shuffle=shuffle)


@functools.lru_cache(maxsize=4)
def _draws(sizes: tuple[int, ...], weights: tuple[float, ...], exhaustion: str, key: int) -> Draws:
    return Draws(sizes, weights, exhaustion, key)


class MixtureView:
    """One rank's records of one epoch of a mixture, by index; the same contract as ``EpochView``."""

    def __init__(self, source: MixtureSource, schedule: Schedule, *, seed: int, epoch: int, shuffle: int) -> None:
        self.source = source
        self.schedule = schedule
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.key = epoch_key(seed, epoch, "mixture")
        self._views: dict[tuple[int, int], EpochView] = {}

    def __len__(self) -> int:
        return self.schedule.count

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_views": {}}

    def __repr__(self) -> str:
        return f"MixtureView({self.source.plan.name!r}, epoch={self.epoch}, {self.schedule.count} records)"

    @property
    def image_size(self) -> int:
        return self.source.components[0].plan.loading.image_size

    def image_shape(self, index: int) -> tuple[int, int]:
        """A mixture's images are squares of its image size."""
        return self.image_size, self.image_size

    def locate(self, index: int) -> tuple[int, int]:
        """(component, k): the record at ``index`` is the k-th draw of that component this epoch."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        draws = _draws(self.source.sizes, self.source.weights, self.source.exhaustion, self.key)
        return draws.locate(self.schedule.at(index))

    def _component_view(self, component: int, round_: int) -> EpochView:
        key = (component, round_)
        if key not in self._views:
            source = self.source.components[component]
            whole = Schedule(len(source), 0, len(source), (len(source),))
            # A component's own epoch: the mixture's, or later ones as ``restart`` starts it over.
            seed = epoch_key(self.seed, component, "component")
            self._views[key] = EpochView(
                # (epoch, round) packed without overlap: round 1000 of epoch 0 is not round 0 of epoch 1.
                source,
                whole,
                seed=seed,
                epoch=(self.epoch << 32) | round_,
                shuffle=self.shuffle,
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

    @property
    def images(self) -> bool:
        return all(component.images for component in self.source.components)

    def finish(self, fetched: Sequence[Fetched], into: np.ndarray | None = None) -> list[dict[str, Any]]:
        """Samples (or markers) of fetched records, each naming its component; images resized into ``into``."""
        return finish(fetched, component=True, into=into)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.finish(self.fetch([index]))[0]


def open_source(plan: Plan, options: LoadOptions | None = None) -> SampleSource | MixtureSource:
    """The source of a Plan's samples: a MixtureSource for a mixture, else a SampleSource."""
    kind = MixtureSource if plan.format == "mixture" else SampleSource
    return kind(plan, options)
