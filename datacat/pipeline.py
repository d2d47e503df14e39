"""A Plan's samples, framework-free: reader, holdout and count, bad-sample policy, transform.

Both backends run these same steps, so a record means the same thing in
torch and jax. Positions are canonical: shards in plan order, records in
shard order, bad records included, so the holdout and ``count`` select the
same records whatever is skipped or however the work is split.

``SampleSource`` reads and transforms records; ``EpochView`` is one rank's
part of one epoch by index, the object worker processes of either backend
read from.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from datacat.epochs import Feistel, Schedule, cumulative, epoch_key, locate, shard_order
from datacat.errors import DatacatError, OptionError, ShardError
from datacat.formats import RawItem, Reader, open_reader
from datacat.plan import Plan
from datacat.schema import BadSamplePolicy
from datacat.storage import is_remote, retry_count
from datacat.transforms.captions import Tokenize
from datacat.transforms.ledger import BadSample, Ledger, bad_marker, error_marker, is_marker
from datacat.transforms.sample import ImageTransform, transform_for

__all__ = ["Allocate", "BatchView", "EpochView", "Fetched", "SampleSource", "collate_numpy", "finish", "selected_range"]

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


class SampleSource:
    """The samples of one Plan, by canonical position (random access) or shard by shard (stream)."""

    def __init__(
        self,
        plan: Plan,
        *,
        tokenize: Tokenize | None = None,
        on_bad_sample: BadSamplePolicy | None = None,
        bad_sample_budget: float | None = None,
    ) -> None:
        if plan.format == "mixture":
            raise OptionError(f"{plan.name} is a mixture: read it with datacat.mixing.MixtureSource")
        if plan.glob is not None:
            raise OptionError(f"{plan.name}: its shards were not listed; resolve it with list_shards=True")
        self.plan = plan
        self.reader: Reader = open_reader(plan)
        self.transform = transform_for(plan, tokenize=tokenize)
        self.ledger = Ledger.for_plan(plan, policy=on_bad_sample, budget=bad_sample_budget)

    def __repr__(self) -> str:
        return f"SampleSource({self.reader!r}, {self.transform!r}, policy={self.ledger.policy!r})"

    @property
    def random_access(self) -> bool:
        """Whether records are read by position (a :class:`~datacat.formats.RandomAccessReader`), else shard by shard."""
        return self.reader.random_access

    def __len__(self) -> int:
        return len(self.selection())

    def epoch_length(self, seed: int, epoch: int) -> int:
        """Records in one epoch: the selection, whatever the seed and epoch."""
        return len(self)

    def view(self, schedule: Schedule, *, seed: int, epoch: int, shuffle: bool) -> EpochView:
        """One rank's records of one epoch, by index."""
        return EpochView(self, schedule, seed=seed, epoch=epoch, shuffle=shuffle)

    def total(self) -> int:
        """Records in all shards, before holdout and count."""
        reader = self.reader
        if reader.random_access:
            return len(reader)
        return self.shard_offsets()[-1]

    def selection(self) -> range:
        """The canonical positions this source reads."""
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
            shard, key = getattr(item, "url", None) or "", getattr(item, "key", None) or f"record {position}"
            return bad_marker(BadSample(self.plan.name, shard, key, str(item)))
        if isinstance(item, BaseException):
            return error_marker(item)
        return self.process(item, epoch=epoch, into=into)

    def sample(self, index: int, *, epoch: int = 0) -> dict[str, Any] | None:
        """The sample at selected position ``index``, or None when the skip policy dropped it."""
        position = self.selection()[index]
        reader = self.reader
        if not reader.random_access:
            raise OptionError(f"{self.plan.name} is read shard by shard: read its samples through an EpochView")
        try:
            (item,) = reader.items([position])
        except (DatacatError, OSError) as exc:
            item = exc
        return self.ledger.admit(self.outcome(item, position, epoch=epoch))


class EpochView:
    """One rank's records of one epoch, by index into its slice of the epoch's sequence.

    ``view[i]`` is a sample or a marker (bad sample, error) for the main
    process's ledger; it never raises, so a worker process of either
    backend hands every outcome back in order. Picklable: workers get copies.
    Stream formats are read front to back; consecutive indices continue
    the open shard instead of reopening it.
    """

    def __init__(self, source: SampleSource, schedule: Schedule, *, seed: int, epoch: int, shuffle: bool) -> None:
        self.source = source
        self.schedule = schedule
        self.epoch = epoch
        selection = source.selection()
        self.first = selection.start
        if source.random_access:
            self.permutation = Feistel(len(selection), epoch_key(seed, epoch)) if shuffle else None
        else:
            offsets = self.offsets = source.shard_offsets()
            order = shard_order(len(source.plan.shards), seed, epoch, shuffle)
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
        return self.schedule.stop - self.schedule.start

    @property
    def image_size(self) -> int:
        return self.source.plan.loading.image_size

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
        return f"EpochView({self.source.plan.name!r}, epoch={self.epoch}, records {self.schedule.start}..{self.schedule.stop})"

    def position(self, index: int) -> int:
        """The canonical position of the record at ``index`` of this rank's slice."""
        if not 0 <= index < len(self):
            raise IndexError(index)
        j = self.schedule.start + index
        if self.source.random_access:
            return self.first + (self.permutation[j] if self.permutation is not None else j)
        part, offset = locate(self.span_starts, j)
        shard, begin, _ = self.spans[part]
        return self.offsets[shard] + begin + offset

    def positions(self, indices: Sequence[int]) -> list[int]:
        """``[self.position(i) for i in indices]``; a random-access batch's shuffle computed at once."""
        if not self.source.random_access or not indices:
            return [self.position(i) for i in indices]
        if min(indices) < 0 or max(indices) >= len(self):
            raise IndexError(min(indices) if min(indices) < 0 else max(indices))
        start, first = self.schedule.start, self.first
        if self.permutation is None:
            return [first + start + i for i in indices]
        return [first + p for p in self.permutation.take([start + i for i in indices])]

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
        part, offset = locate(self.span_starts, self.schedule.start + index)
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


class BatchView:
    """One rank's batches of one epoch, by batch index: what a worker process computes whole.

    ``view[b]`` reads the records of batch ``b`` (its slice of the schedule)
    in one concurrent fetch, transforms them, and returns ``{"batch": ...,
    "marks": [...]}``: the good samples in order, collated to numpy arrays,
    and the markers of bad ones or errors, for the main process's ledger.
    While a batch decodes, the next ``read_ahead`` batches this process
    will ask for (the stride of its last two requests) are fetched in a
    thread, one per batch for remote shards, so storage latency hides
    behind the CPU work (two batches in two threads: one thread held a
    worker to ~0.7 of its rate at 80 ms a request; three batches cost more
    CPU than they saved). The threads are the process's (:func:`_read_pool`),
    kept from one epoch's view to the next. Never raises for data: errors
    travel as markers.
    """

    def __init__(
        self,
        view: EpochView | Any,
        *,
        read_ahead: int = 2,
        origin: int | None = None,
        allocate: Allocate | None = None,
    ) -> None:
        self.view = view  # an EpochView, or a mixing.MixtureView: the same contract
        self.image_size = view.image_size
        self.allocate = allocate
        self.starts = cumulative(view.schedule.batch_sizes)
        self.read_ahead = read_ahead if getattr(view, "random_access", False) else 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the process's _read_pool, once used
        self._pid = 0
        self._pending: dict[int, concurrent.futures.Future[list[Fetched]]] = {}
        self._last: int | None = None
        self._upcoming: Sequence[int] | None = None
        self._retried = retry_count()
        self._origin = os.getpid() if origin is None else origin  # the loader's process, which counts its own retries

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __repr__(self) -> str:
        return f"BatchView({self.view!r}, batches={len(self)})"

    def __getstate__(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "_pool": None,
            "_pid": 0,
            "_pending": {},
            "_last": None,
            "_upcoming": None,
            "_retried": 0,
        }

    def _fetch(self, batch: int) -> list[Fetched]:
        fetched: list[Fetched] = self.view.fetch(range(self.starts[batch], self.starts[batch + 1]))
        return fetched

    def close(self) -> None:
        """Stops reading ahead: pending reads are cancelled (the process's read threads stay for the next view)."""
        if self._pool is not None and self._pid == os.getpid():
            for future in self._pending.values():
                future.cancel()
        self._pool, self._pending = None, {}

    def plan_reads(self, batches: Sequence[int]) -> None:
        """Tells the view which batches this process will ask for (ascending), so it reads ahead exactly those."""
        self._upcoming = batches

    def _read_ahead(self, batch: int) -> None:
        if not self.read_ahead:
            return
        if self._pool is None or self._pid != os.getpid():  # a forked copy has no live threads
            threads = self.read_ahead if _reads_remote(self.view) else 1  # a local read takes microseconds
            self._pool, self._pid, self._pending = _read_pool(threads), os.getpid(), {}
        if self._upcoming is not None:
            at = bisect.bisect_right(self._upcoming, batch)
            later = list(self._upcoming[at : at + self.read_ahead])
        elif self._last is not None and batch > self._last:
            # Unplanned (grain's workers take every n-th batch): the stride of the last two requests.
            stride = batch - self._last
            later = [batch + k * stride for k in range(1, self.read_ahead + 1)]
        else:
            later = []  # no stride yet: a guess would fetch another worker's batch
        self._last = batch
        for stale in [b for b in self._pending if b <= batch]:
            self._pending.pop(stale).cancel()
        for ahead in later:
            if ahead < len(self) and ahead not in self._pending:
                self._pending[ahead] = self._pool.submit(self._fetch, ahead)

    def __getitem__(self, batch: int) -> dict[str, Any]:
        future = self._pending.pop(batch, None) if self._pid == os.getpid() else None
        fetched = future.result() if future is not None else self._fetch(batch)
        self._read_ahead(batch)
        samples: list[dict[str, Any]] = []
        marks: list[dict[str, Any]] = []
        # Images are resized straight into the batch's rows: no per-image array, no copy to collate.
        size = self.image_size
        images = (self.allocate or _empty)((len(fetched), size, size, 3)) if self.view.images else None
        for output in self.view.finish(fetched, into=images):
            (marks if is_marker(output) else samples).append(output)
        # Retries made by a worker process since its last batch (prefetch threads included); the
        # loader counts its own process's itself.
        retries, self._retried = retry_count() - self._retried, retry_count()
        if os.getpid() == self._origin:
            retries = 0
        collated = collate_numpy(samples, images)
        return {"batch": collated, "marks": marks, "retries": retries}


_READ_POOLS: dict[tuple[int, int], concurrent.futures.ThreadPoolExecutor] = {}


def _read_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """This process's read-ahead pool of ``threads`` threads: one for every view, kept while the process lives.

    A pool per view started a thread every epoch, and glibc gives a new
    thread a malloc arena of its own when the last one's is not yet free,
    whose pages are then faulted in and zeroed afresh: torch over local
    ArrayRecords spent 3 page faults and 46 µs of kernel time an image on
    it, against 0.1 and 15 µs with one thread kept (4 epochs of 2000 photos,
    one process). Keyed by pid: a forked child inherits the pools but none
    of their threads.
    """
    key = (os.getpid(), threads)
    pool = _READ_POOLS.get(key)
    if pool is None:  # two threads racing here make two pools; setdefault keeps one (threads start on first submit)
        made = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="datacat-read")
        pool = _READ_POOLS.setdefault(key, made)
    return pool


def _reads_remote(view: Any) -> bool:
    """Whether a view's records come from remote storage (an EpochView's source, or any of a mixture's)."""
    source = getattr(view, "source", None)
    sources = getattr(source, "components", None) or [source]
    return any(is_remote(shard.url) for s in sources for shard in getattr(getattr(s, "plan", None), "shards", ())[:1])


Allocate = Callable[[tuple[int, ...]], np.ndarray]
"""Makes an empty uint8 array of a shape: the batch its images are resized into (torch gives shared memory)."""


def _empty(shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, np.uint8)


def collate_numpy(samples: list[dict[str, Any]], images: np.ndarray | None) -> dict[str, Any]:
    """A batch of samples as numpy arrays (image, label, embeddings) and lists (caption, key, tokens).

    ``images`` is the batch array the samples' images were resized into, a
    row per fetched record (None for embedding-table rows, which have no
    image): the images stay where they are, the rows after a bad sample are
    moved up, and the batch's image is ``images[:n]``.
    """
    batch: dict[str, Any] = {"key": [s["key"] for s in samples]}
    if images is not None:
        for row, sample in enumerate(samples):
            pixels = sample["image"]
            # Rows do not overlap, so an image sharing memory with this row is the row (cheaper than .ctypes).
            if pixels.shape != images.shape[1:] or not np.may_share_memory(pixels, images[row]):
                images[row] = pixels  # a row after a bad sample, or an image made elsewhere (augmented)
        batch["image"] = images[: len(samples)]
    for name in ("image_embedding", "text_embedding"):
        if samples and name in samples[0]:
            batch[name] = np.stack([s[name] for s in samples])
    if not samples or "caption" in samples[0]:  # image-only entries have none
        batch["caption"] = [s["caption"] for s in samples]
    if samples and "label" in samples[0]:
        batch["label"] = np.asarray([s["label"] for s in samples], dtype=np.int64)
    if samples and "embedding" in samples[0]:
        batch["embedding"] = np.stack([s["embedding"] for s in samples])
    if samples and "tokens" in samples[0]:
        batch["tokens"] = [s["tokens"] for s in samples]
    if samples and "component" in samples[0]:
        batch["component"] = [s["component"] for s in samples]
    return batch
