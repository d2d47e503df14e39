"""One rank's batches of one epoch by batch index, their records read ahead in threads while a batch decodes.

A :class:`BatchView` is what a worker process of either backend computes
whole: the records of one batch of a :class:`~datacat.loading.contracts.Records`
fetched at once, transformed, and collated.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from datacat.loading.collate import array_keys, collate_numpy, field_keys
from datacat.loading.contracts import Records
from datacat.loading.epochs import cumulative
from datacat.loading.filling import FilledBatch, batch_fill, fill_batch, finish_filled
from datacat.loading.pace import Pace
from datacat.loading.sources import EpochView, Fetched
from datacat.storage import retry_count
from datacat.transforms.ledger import is_marker

__all__ = ["Allocate", "BatchView"]


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
    kept from one epoch's view to the next. A batch its format fills in one
    thread is read ahead only while the loop's :class:`~datacat.loading.pace.Pace`
    says it pays; else the loop reads it when it asks. Never raises for
    data: errors travel as markers.
    """

    def __init__(
        self,
        view: Records,
        *,
        read_ahead: int = 2,
        origin: int | None = None,
        allocate: Allocate | None = None,
        pace: Pace | None = None,
    ) -> None:
        self.view = view  # an EpochView, or a MixtureView
        self.arrays = array_keys(view.source.plan)
        self.fields = field_keys(view.source.plan)
        self.image_size = view.image_size
        self.allocate = allocate
        self.starts = cumulative(view.schedule.batch_sizes)
        self.read_ahead = read_ahead if view.random_access else 0
        self.fill = batch_fill(view)  # the format's batch path: arrays read straight into the batch
        self.pace = pace if pace is not None else Pace()  # the loop's, kept across epochs by Epochs
        self.thread_count = self._thread_count()  # the view's read threads, worked out once
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # the process's _read_pool, once used
        self._pid = 0
        self._pending: dict[int, concurrent.futures.Future[list[Fetched] | FilledBatch | None]] = {}
        self._last: int | None = None
        self._left: float | None = None  # when the loop took its last batch of this view
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
            "_left": None,
            "_upcoming": None,
            "_retried": 0,
        }

    def _fetch(self, batch: int) -> list[Fetched] | FilledBatch | None:
        # A filled batch (None: its shard failed, read it the ordinary way), or the batch's fetched records.
        indices = range(self.starts[batch], self.starts[batch + 1])
        if self.fill is not None:
            assert isinstance(self.view, EpochView)
            began = time.perf_counter()
            filled = fill_batch(self.view, self.fill, indices, self.allocate)
            self.pace.read(time.perf_counter() - began)
            return filled
        return self.view.fetch(indices)

    def close(self) -> None:
        """Stops reading ahead: pending reads are cancelled (the process's read threads stay for the next view)."""
        if self._pool is not None and self._pid == os.getpid():
            for future in self._pending.values():
                future.cancel()
        self._pool, self._pending = None, {}

    def plan_reads(self, batches: Sequence[int]) -> None:
        """Tells the view which batches this process will ask for (ascending), so it reads ahead exactly those."""
        self._upcoming = batches

    def start(self) -> None:
        """Starts reading the first batches this process will ask for, before it asks for any."""
        if not self._reads_ahead() or self._upcoming is None:
            return
        pool = self._threads()
        for ahead in self._upcoming[: self.read_ahead]:
            if ahead not in self._pending:
                self._pending[ahead] = pool.submit(self._fetch, ahead)

    def _thread_count(self) -> int:
        # A local read takes microseconds, but filling a batch is the whole of its work: threads fill side by side.
        if self.view.source.remote:
            return self.read_ahead
        if self.fill is not None:
            assert isinstance(self.view, EpochView)
            return self.fill.threads(self.view.run)
        return 1

    def _reads_ahead(self) -> bool:
        # Fills side by side beat one in any loop; one fill thread pays only while the loop is away long enough.
        if not self.read_ahead:
            return False
        return self.fill is None or self.thread_count > 1 or self.pace.ahead  # fills are of local shards

    def _threads(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None or self._pid != os.getpid():  # a forked copy has no live threads
            self._pool, self._pid, self._pending = _read_pool(self.thread_count), os.getpid(), {}
        return self._pool

    def _read_ahead(self, batch: int) -> None:
        if not self.read_ahead:
            return
        for stale in [b for b in self._pending if b <= batch]:
            self._pending.pop(stale).cancel()
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
        if not self._reads_ahead():
            return
        pool = self._threads()
        for ahead in later:
            if ahead < len(self) and ahead not in self._pending:
                self._pending[ahead] = pool.submit(self._fetch, ahead)

    def __getitem__(self, batch: int) -> dict[str, Any]:
        if self._left is not None:
            self.pace.away(time.perf_counter() - self._left)
        try:
            return self._build(batch)
        finally:
            self._left = time.perf_counter()

    def _build(self, batch: int) -> dict[str, Any]:
        future = self._pending.pop(batch, None) if self._pid == os.getpid() else None
        if future is None:
            fetched = self._fetch(batch)
        else:
            began = time.perf_counter()
            fetched = future.result()
            self.pace.waited(time.perf_counter() - began)
        self._read_ahead(batch)
        if self.fill is not None:
            assert isinstance(self.view, EpochView)
            if fetched is None:
                fetched = self.view.fetch(range(self.starts[batch], self.starts[batch + 1]))
            else:
                assert isinstance(fetched, tuple)
                collated, filled_marks = finish_filled(self.view, fetched)
                return {"batch": collated, "marks": filled_marks, "retries": self._retries()}
        assert isinstance(fetched, list)
        samples: list[dict[str, Any]] = []
        marks: list[dict[str, Any]] = []
        # Images are resized straight into the batch's rows: no per-image array, no copy to collate.
        height, width = self.view.image_shape(self.starts[batch]) if fetched else (self.image_size, self.image_size)
        images = (self.allocate or _empty)((len(fetched), height, width, 3)) if self.view.images else None
        for output in self.view.finish(fetched, into=images):
            (marks if is_marker(output) else samples).append(output)
        collated = collate_numpy(samples, images, self.arrays, self.fields)
        return {"batch": collated, "marks": marks, "retries": self._retries()}

    def _retries(self) -> int:
        # Retries made by a worker process since its last batch (prefetch threads included); the
        # loader counts its own process's itself.
        retries, self._retried = retry_count() - self._retried, retry_count()
        return 0 if os.getpid() == self._origin else retries


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


Allocate = Callable[[tuple[int, ...]], np.ndarray]
"""Makes an empty uint8 array of a shape: the batch its images are resized into (torch gives shared memory)."""


def _empty(shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, np.uint8)
