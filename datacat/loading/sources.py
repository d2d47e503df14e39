"""A Plan's samples by canonical position, and one rank's records of one epoch of them.

``SampleSource`` reads and transforms the records of one Plan: reader,
holdout and count, bad-sample policy, transform. Both backends run these
same steps, so a record means the same thing in torch and jax. Positions
are canonical: shards in plan order, records in shard order, bad records
included, so the holdout and ``count`` select the same records whatever is
skipped or however the work is split.

``EpochView`` is one rank's part of one epoch by index, the object worker
processes of either backend read from (a :class:`~datacat.loading.contracts.Records`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from datacat.errors import DatacatError, OptionError, ShardError
from datacat.formats import BatchFill, RawItem, Reader, open_reader
from datacat.formats.selection import Selection, build_selection, stored_sizes
from datacat.loading.buckets import Bucketing, nearest_buckets
from datacat.loading.epochs import Schedule, cumulative, locate
from datacat.loading.options import LoadOptions
from datacat.loading.shuffle import Feistel, Order, RunShuffle, epoch_key, shard_order
from datacat.plan import Plan
from datacat.registry import format_of
from datacat.storage import is_remote
from datacat.storage.shard_cache import serve
from datacat.transforms.ledger import BadSample, Ledger, bad_marker, error_marker, is_marker
from datacat.transforms.sample import ImageTransform, transform_for

__all__ = ["EpochView", "Fetched", "SampleSource", "finish", "ledger_for", "reads_remote", "selected_range"]

_READ_AHEAD = 256


def selected_range(plan: Plan, total: int) -> range:
    """The canonical positions a plan reads out of ``total`` records: holdout and count applied."""
    head = plan.holdout_records
    if plan.from_holdout:
        return range(min(head, total))
    if head and head >= total:
        raise OptionError(
            f"{plan.name}: the validation holdout ({plan.loading.val_batches} batches x {plan.batch_size} = {head} records) "
            f"is the whole dataset ({total} records); lower val_batches"
        )
    stop = total if plan.loading.count is None else min(total, head + plan.loading.count)
    return range(head, stop)


def reads_remote(plan: Plan) -> bool:
    """Whether a Plan's records come from remote storage: its shards' (which share one root), or any component's."""
    if plan.components:
        return any(reads_remote(component.plan) for component in plan.components)
    return any(is_remote(shard.url) for shard in plan.shards[:1])


def ledger_for(plan: Plan, options: LoadOptions | None) -> Ledger:
    """The ledger of a Plan: its entry's bad-sample policy and budget, unless ``options`` override them."""
    if options is None:
        return Ledger.for_plan(plan)
    return Ledger.for_plan(plan, policy=options.on_bad_sample, budget=options.bad_sample_budget)


class SampleSource:
    """The samples of one Plan, by canonical position (random access) or shard by shard (stream)."""

    def __init__(self, plan: Plan, options: LoadOptions | None = None) -> None:
        if plan.format == "mixture":
            raise OptionError(f"{plan.name} is a mixture: read it with datacat.loading.mixture.MixtureSource")
        if plan.glob is not None:
            raise OptionError(f"{plan.name}: its shards were not listed; resolve it with list_shards=True")
        self.plan = plan
        self.shard_cache = None if options is None or not reads_remote(plan) else options.shard_cache
        self._serve()
        self.reader: Reader = open_reader(plan)
        positional = [
            what for what, asked in (("select", plan.select), ("loading.buckets", plan.loading.buckets)) if asked
        ]
        if positional and not self.reader.random_access:
            raise OptionError(
                f"{plan.name}: {' and '.join(positional)} need records read by position, and a gzip-compressed tar "
                f"is read front to back; decompress its shards or drop {' and '.join(positional)}"
            )
        # The records that meet the entry's select (None: every record), and their aspect-ratio buckets.
        self.chosen: Selection | None = build_selection(plan, self.reader.counts) if plan.select else None
        self.bucketing = self._bucketing() if plan.loading.buckets is not None else None
        self.transform = transform_for(plan, tokenize=None if options is None else options.tokenize)
        self.ledger = ledger_for(plan, options)
        declared = format_of(plan.format).fill
        # The format's batch path (arrays read straight into a batch), when this plan's records allow it.
        self.fill: BatchFill | None = None if declared is None else declared(self.reader, plan)

    def _bucketing(self) -> Bucketing:
        """Each selected record's aspect-ratio bucket, from its stored image's size in the metadata table."""
        buckets = self.plan.loading.buckets
        assert buckets is not None
        stored = stored_sizes(self.plan, self.reader.counts)
        picked = np.arange(self.selection().start, self.selection().stop)
        canonical = picked if self.chosen is None else self.chosen.positions[picked]
        return Bucketing(self.plan.name, buckets.resolved(), nearest_buckets(buckets.resolved(), stored[canonical]))

    def _serve(self) -> None:
        """Reads of this plan's shards in this process use the shard cache's copies (before any read)."""
        if self.shard_cache is not None:
            serve(self.shard_cache, [shard.url for shard in self.plan.shards])

    def __setstate__(self, state: dict[str, Any]) -> None:  # in a spawned worker: its reads use the cache too
        self.__dict__.update(state)
        self._serve()

    def __repr__(self) -> str:
        return f"SampleSource({self.reader!r}, {self.transform!r}, policy={self.ledger.policy!r})"

    @property
    def random_access(self) -> bool:
        """Whether records are read by position (a :class:`~datacat.formats.RandomAccessReader`), else shard by shard."""
        return self.reader.random_access

    @property
    def remote(self) -> bool:
        """Whether the shards are in remote storage."""
        return reads_remote(self.plan)

    def __len__(self) -> int:
        return len(self.selection())

    def epoch_length(self, seed: int, epoch: int) -> int:
        """Records in one epoch: the selection, whatever the seed and epoch."""
        return len(self)

    def view(self, schedule: Schedule, *, seed: int, epoch: int, shuffle: int) -> EpochView:
        """One rank's records of one epoch, by index; ``shuffle``: 0 (False) in order, else its run (True: 1)."""
        return EpochView(self, schedule, seed=seed, epoch=epoch, shuffle=shuffle)

    def total(self) -> int:
        """Records in all shards (those the entry selects), before holdout and count."""
        reader = self.reader
        if self.chosen is not None:
            return len(self.chosen)
        if reader.random_access:
            return len(reader)
        return self.shard_offsets()[-1]

    def selection(self) -> range:
        """The positions this source reads: canonical ones, or with ``select`` indices into :attr:`chosen`."""
        return selected_range(self.plan, self.total())

    def shard_offsets(self) -> list[int]:
        """The canonical position of each shard's first record, then the total; needs per-shard counts."""
        counted = self.reader.counts  # a reader that counted its shards when opened
        counts = list(counted) if counted else [s.samples for s in self.plan.shards]
        if any(c is None for c in counts):
            missing = [s.name for s in self.plan.shards if s.samples is None][:3]
            raise OptionError(
                f"{self.plan.name}: reading a stream format by position needs the records of every shard "
                f"(none declared for {', '.join(missing)}...); declare totals.per_shard in the catalog entry "
                f"(`datacat count {self.plan.name}` counts them and prints the lines to paste)"
            )
        return cumulative([c or 0 for c in counts])

    @property
    def images(self) -> bool:
        """Whether samples have an ``image`` (embedding-table rows have none)."""
        return isinstance(self.transform, ImageTransform)

    def process(self, item: RawItem, *, epoch: int = 0, into: np.ndarray | None = None) -> dict[str, Any]:
        """The sample of one raw item (its image resized into ``into`` when given), or a bad-sample marker."""
        try:
            return self.transform(self.reader.parse(item), epoch=epoch, into=into)
        except ValueError as exc:  # RecordError is a ValueError too
            return bad_marker(BadSample(self.plan.name, item.shard, item.key, str(exc)))

    def outcome(
        self, item: RawItem | BaseException, position: int, *, epoch: int = 0, into: np.ndarray | None = None
    ) -> dict[str, Any]:
        """The sample of a fetched record, or a marker: a bad sample (a record that cannot be parsed) or an error."""
        if isinstance(item, ValueError):  # RecordError too
            named = item if isinstance(item, ShardError) else None
            shard = (named.url if named is not None else None) or ""
            key = (named.key if named is not None else None) or f"record {position}"
            return bad_marker(BadSample(self.plan.name, shard, key, str(item)))
        if isinstance(item, BaseException):
            return error_marker(item)
        return self.process(item, epoch=epoch, into=into)


class EpochView:
    """One rank's records of one epoch, by index into its slice of the epoch's sequence.

    ``view[i]`` is a sample or a marker (bad sample, error) for the main
    process's ledger; it never raises, so a worker process of either
    backend hands every outcome back in order. Picklable: workers get copies.
    Stream formats are read front to back; consecutive indices continue
    the open shard instead of reopening it.
    """

    def __init__(self, source: SampleSource, schedule: Schedule, *, seed: int, epoch: int, shuffle: int) -> None:
        self.source = source
        self.schedule = schedule
        self.epoch = epoch
        selection = source.selection()
        self.first = selection.start
        self.run = shuffle if shuffle > 1 else 1 if shuffle else 0
        """Neighbouring records the order moves together: ``shuffle_run``, 1 each record on its own, 0 not shuffled."""
        if source.random_access:
            self.permutation: Order | None = None
            if schedule.order is not None:  # a bucketed epoch's own sequence
                self.permutation = _Order(schedule.order)
            elif shuffle > 1:
                self.permutation = RunShuffle(len(selection), epoch_key(seed, epoch), shuffle)
            elif shuffle:
                self.permutation = Feistel(len(selection), epoch_key(seed, epoch))
        else:
            offsets = self.offsets = source.shard_offsets()
            order = shard_order(len(source.plan.shards), seed, epoch, bool(shuffle))
            # Each shard contributes its selected records, [begin, end) within the shard.
            spans = []
            for shard in order:
                begin = max(selection.start, offsets[shard]) - offsets[shard]
                end = min(selection.stop, offsets[shard + 1]) - offsets[shard]
                if end > begin:
                    spans.append((shard, begin, end))
            self.spans = spans
            self.span_starts = cumulative([end - begin for _, begin, end in spans])
        self._cursor: tuple[int, int, Iterator[RawItem]] | None = None
        # Reader threads (grain reads a source from several) ask for neighbouring indices out of
        # order; records read past on the way are kept here until asked for.
        self._ahead: dict[tuple[int, int], RawItem] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.schedule.count

    @property
    def image_size(self) -> int:
        return self.source.plan.loading.image_size

    def image_shape(self, index: int) -> tuple[int, int]:
        """(height, width) the images of the batch holding this slice's ``index``-th record are resized to."""
        bucketing = self.source.bucketing
        if bucketing is None or not self.schedule.step_buckets:
            return self.image_size, self.image_size
        return bucketing.sizes[self.schedule.bucket_at(self.schedule.at(index))]

    @property
    def random_access(self) -> bool:
        return self.source.random_access

    @property
    def images(self) -> bool:
        return self.source.images

    def finish(self, fetched: Sequence[Fetched], into: np.ndarray | None = None) -> list[dict[str, Any]]:
        """Samples (or markers) of fetched records; record ``i``'s image resized into ``into[i]`` when given."""
        return finish(fetched, into=into)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cursor": None, "_ahead": {}, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EpochView({self.source.plan.name!r}, epoch={self.epoch}, {self.schedule.count} records)"

    def position(self, index: int) -> int:
        """The canonical position of the record at ``index`` of this rank's slice."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        j = self.schedule.at(index)
        if self.source.random_access:
            k = self.first + (self.permutation[j] if self.permutation is not None else j)
            return k if self.source.chosen is None else self.source.chosen.take([k])[0]
        part, offset = locate(self.span_starts, j)
        shard, begin, _ = self.spans[part]
        return self.offsets[shard] + begin + offset

    def positions(self, indices: Sequence[int]) -> list[int]:
        """``[self.position(i) for i in indices]``; a random-access batch's shuffle computed at once."""
        if not self.source.random_access or not indices:
            return [self.position(i) for i in indices]
        out: list[int] = self.positions_array(indices).tolist()
        return out

    def positions_array(self, indices: Sequence[int]) -> np.ndarray:
        """:meth:`positions` of a random-access slice as an int64 array, no Python int made per record."""
        if not indices:
            return np.zeros(0, np.int64)
        low, high = (
            (indices[0], indices[-1])
            if isinstance(indices, range) and indices.step > 0
            else (min(indices), max(indices))
        )
        if low < 0 or high >= len(self):
            raise IndexError(low if low < 0 else high)
        span = self.schedule.at_range(indices)
        if span is not None and self.permutation is not None:  # a batch's own neighbouring indices
            picked = self.permutation.take_range(span.start, span.stop)
        else:
            sequence = self.schedule.at_array(indices)
            picked = sequence if self.permutation is None else self.permutation.take_array(sequence)
        picked = picked + self.first
        return picked if self.source.chosen is None else np.asarray(self.source.chosen.positions[picked], np.int64)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return finish(self.fetch([index]))[0]

    def fetch(self, indices: Sequence[int]) -> list[Fetched]:
        """The raw records at ``indices`` of this slice (a random-access batch in one concurrent read), or their errors."""
        reader = self.source.reader
        if reader.random_access:
            positions = self.positions(indices)
            try:
                items: list[RawItem | BaseException] = list(reader.items(positions))
            except (DatacatError, OSError) as exc:  # the shard cannot be opened: every record of it fails alike
                items = [exc] * len(positions)
            return [(self, item, position) for item, position in zip(items, positions, strict=True)]
        out: list[Fetched] = []
        for index in indices:
            try:
                out.append((self, self._item(index), self.position(index)))
            except (DatacatError, OSError) as exc:
                out.append((self, exc, self.position(index)))
        return out

    def _item(self, index: int) -> RawItem:
        # The next record of a stream, read front to back from the open shard.
        reader = self.source.reader
        assert not reader.random_access, "random-access records are fetched by items()"
        part, offset = locate(self.span_starts, self.schedule.at(index))
        shard, begin, _ = self.spans[part]
        local = begin + offset
        with self._lock:
            if (shard, local) in self._ahead:
                return self._ahead.pop((shard, local))
            if self._cursor is None or self._cursor[0] != shard or self._cursor[1] > local:
                self._cursor = (shard, 0, reader.iter_shard(shard))
            _, at, items = self._cursor
            self._cursor = None  # until this read succeeds: a failed shard is opened afresh next time
            for position in range(at, local + 1):
                item = next(items, None)
                if item is None:
                    declared = self.source.plan.shards[shard].samples
                    raise ShardError(
                        f"shard {self.source.plan.shards[shard].url} ended after {position} records, but the catalog "
                        f"declares {declared}; correct totals.per_shard (datacat count {self.source.plan.name})"
                    )
                if position < local and local - position <= _READ_AHEAD:
                    self._ahead[(shard, position)] = item  # read past, not decoded; another thread may want it
            self._cursor = (shard, local + 1, items)
            while len(self._ahead) > _READ_AHEAD:
                self._ahead.pop(next(iter(self._ahead)))
            assert item is not None  # the loop ran at least once and raised on None
            return item


Fetched = tuple[EpochView, "RawItem | BaseException", int]
"""A record as fetched: the view it belongs to, its raw item (or why it could not be read), its position."""


def finish(fetched: Sequence[Fetched], component: bool = False, into: np.ndarray | None = None) -> list[dict[str, Any]]:
    """Each fetched record as a sample, or a marker for the main process's ledger (bad sample or error).

    With ``into``, record ``i``'s image is resized into ``into[i]``.
    """
    out = []
    for slot, (view, item, position) in enumerate(fetched):
        row = None if into is None else into[slot]
        output = view.source.outcome(item, position, epoch=view.epoch, into=row)
        if component and not is_marker(output):
            output["component"] = view.source.plan.name
        out.append(output)
    return out


class _Order:
    """A bucketed epoch's sequence, read as a shuffle is: ``order[j]`` and ``order.take(js)``."""

    def __init__(self, order: np.ndarray) -> None:
        self.order = order

    def __getitem__(self, index: int) -> int:
        return int(self.order[index])

    def take(self, indices: Sequence[int]) -> list[int]:
        out: list[int] = self.take_array(np.asarray(indices, dtype=np.int64)).tolist()
        return out

    def take_array(self, indices: np.ndarray) -> np.ndarray:
        taken: np.ndarray = self.order[indices]
        return taken

    def take_range(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= len(self.order):
            raise IndexError(start if start < 0 else stop - 1)
        return np.asarray(self.order[start:stop], np.int64)
