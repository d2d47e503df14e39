"""What both backends share: the epoch loop, batching by schedule, the ledger, and resumable state.

A backend supplies only ``_batches(epoch, first)``: the outputs of that
epoch's ``BatchView`` from batch ``first`` on, in batch order, computed in
its own worker processes (each worker builds whole batches: one message per
batch; ``Epochs`` lets a worker build any epoch's view itself, so workers
live across epochs), and ``_finish`` to turn a collated numpy batch into its
framework's batch.
"""

from __future__ import annotations

import atexit
import bisect
import ctypes
import gc
import logging
import os
import sys
import weakref
from collections.abc import Generator, Iterator
from typing import Any

from datacat.epochs import Schedule, plan_schedule
from datacat.errors import DatacatError, OptionError, PlanMismatch
from datacat.mixing import open_source
from datacat.pipeline import Allocate, BatchView
from datacat.plan import Plan
from datacat.schema import BadSamplePolicy
from datacat.storage import retry_count
from datacat.transforms.captions import Tokenize
from datacat.transforms.ledger import Ledger

__all__ = ["EpochRun", "Epochs", "Loader", "keep_freed_memory"]

log = logging.getLogger(__name__)
STATE_VERSION = 1
HOLDOUT_SHARE = 0.1
"""A holdout over this share of the records is warned of: a default meant for millions met a small set."""
_ENDLESS = 1 << 48  # the length of an endless EpochRun (grain needs a length)


class Epochs:
    """One rank's epochs of one source, cut into batches: picklable, so a worker builds any epoch's view.

    ``batches(epoch)`` is the same ``BatchView`` in every process, since
    everything it depends on (source, seed, rank, batch size) is here.
    """

    def __init__(
        self,
        source: Any,
        *,
        name: str,
        seed: int,
        shuffle: bool,
        rank: int,
        world_size: int,
        batch_size: int,
        drop_remainder: bool,
    ) -> None:
        self.source = source  # a SampleSource or MixtureSource
        self.name, self.seed, self.shuffle = name, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.drop_remainder = batch_size, drop_remainder
        self.origin = os.getpid()  # the loader's process: workers report their retries to it
        self.allocate: Allocate | None = None  # where batches are collated; a backend may give shared memory

    def __repr__(self) -> str:
        return f"Epochs({self.name!r}, rank={self.rank}/{self.world_size}, batch_size={self.batch_size})"

    def schedule(self, epoch: int) -> Schedule:
        """Which records of epoch ``epoch`` this rank reads, in which batches."""
        return plan_schedule(
            self.source.epoch_length(self.seed, epoch),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            drop_remainder=self.drop_remainder,
            name=self.name,
        )

    def batches(self, epoch: int) -> BatchView:
        """This rank's batches of epoch ``epoch``, by batch index."""
        view = self.source.view(self.schedule(epoch), seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        return BatchView(view, origin=self.origin, allocate=self.allocate)


class EpochRun:
    """Every batch of epochs ``epoch, epoch + 1, ...`` until ``last`` (None: endless) from batch ``first`` of the first, as one sequence.

    Element ``i`` is built by its epoch's BatchView, made in the process that
    reads it when first needed (workers read their indices in order, so only
    the current epoch's view is kept). A pool of workers reading one run
    crosses from one epoch into the next without waiting for the last
    batch of the first to be taken. ``stride(worker, workers)`` says this
    process reads elements ``worker, worker + workers, ...``, so each view
    reads ahead exactly those.
    """

    def __init__(self, epochs: Epochs, epoch: int, first: int, last: int | None) -> None:
        self.epochs, self.epoch, self.first, self.last = epochs, epoch, first, last
        self._starts = [0]  # element index where each epoch from self.epoch begins
        self._view: tuple[int, BatchView] | None = None
        self._stride: tuple[int, int] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_view": None}

    def __repr__(self) -> str:
        return f"EpochRun({self.epochs!r}, from epoch {self.epoch} batch {self.first}, until {self.last})"

    def __len__(self) -> int:
        if self.last is None:
            return _ENDLESS
        while len(self._starts) <= self.last - self.epoch:
            self._grow()
        return self._starts[self.last - self.epoch]

    def stride(self, worker: int, workers: int) -> None:
        """This process reads every ``workers``-th element from ``worker`` on."""
        self._stride = (worker, workers)

    def _grow(self) -> None:
        epoch = self.epoch + len(self._starts) - 1
        skipped = self.first if epoch == self.epoch else 0
        self._starts.append(self._starts[-1] + self.epochs.schedule(epoch).batches - skipped)

    def __getitem__(self, index: int) -> dict[str, Any]:
        while self._starts[-1] <= index:
            self._grow()
        offset = bisect.bisect_right(self._starts, index) - 1
        skipped = self.first if offset == 0 else 0
        if self._view is None or self._view[0] != self.epoch + offset:
            self.close()
            self._view = (self.epoch + offset, self.epochs.batches(self.epoch + offset))
            if self._stride is not None:
                worker, workers = self._stride
                mine = self._starts[offset] + (worker - self._starts[offset]) % workers  # this process's first here
                self._view[1].plan_reads(range(mine - self._starts[offset] + skipped, len(self._view[1]), workers))
        return self._view[1][index - self._starts[offset] + skipped]

    def close(self) -> None:
        """Stops the current view's read-ahead."""
        if self._view is not None:
            self._view[1].close()
            self._view = None


def keep_freed_memory() -> None:
    """In a worker process: glibc's malloc keeps memory freed for the next sample instead of unmapping it.

    A sample's bytes, the copies array_record makes of a record (0.1-0.3 MB
    each) and a decoded image (0.1-3 MB) lie over glibc's adaptive mmap
    threshold, or at the top of the read-ahead thread's arena, which it
    trims: by default each is mapped afresh and faulted in page by page.
    Fixed thresholds (a worker's working set is a few batches) cut a torch
    worker's sys time from 0.12 to 0.05 ms an image, and grain workers'
    over ArrayRecord from 0.09 to 0.03 ms (16 page faults an image to 0.5;
    2 pairs over the referee's corpus, 2026-12-02). Other C libraries keep
    their own malloc's choices.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc's; musl's does nothing
    except (OSError, AttributeError):
        return
    mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD: free memory kept at the top of a heap before returning it
    mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD (its maximum): blocks under it come from the heaps


_OPEN: weakref.WeakSet[Loader] = weakref.WeakSet()  # loaders of this process, closed at its exit


def _close_open_loaders() -> None:
    # A loop left with break leaves its iterator suspended. Closed here, at exit, while the modules are
    # whole: at interpreter teardown its cleanup (and grain's) would fail with a traceback, and grain's
    # in-flight batches would be left in /dev/shm for the resource tracker to complain about. Registered
    # again by each new iterator, so it runs before the exit hooks of what the loader started (atexit
    # runs the last registered first).
    for loader in list(_OPEN):
        try:
            loader._close_iterators()
            loader.close()
        except Exception as exc:  # exiting anyway: one line, not a traceback
            log.debug("closing %r at exit: %s", loader, exc)
    gc.collect()  # grain's iterators sit in reference cycles: their finalisers free the in-flight segments


class Loader:
    """Batches of one Plan for one rank, epoch after epoch, resumable from ``state_dict()``.

    Every record of the split is delivered once per epoch across ranks and
    workers; every rank gets the same number of batches (see
    :mod:`datacat.epochs`). A batch holds the records its schedule assigns,
    less any that the ``skip`` policy dropped.
    """

    framework = ""

    def __init__(
        self,
        plan: Plan,
        *,
        batch_size: int,
        epochs: int | None = 1,
        shuffle: bool = True,
        num_workers: int = 0,
        drop_remainder: bool = False,
        rank: int = 0,
        world_size: int = 1,
        on_bad_sample: BadSamplePolicy | None = None,
        bad_sample_budget: float | None = None,
        tokenize: Tokenize | None = None,
    ) -> None:
        if num_workers < 0:
            raise OptionError(f"num_workers must be 0 or more, not {num_workers}")
        if epochs is not None and epochs < 1:
            raise OptionError(f"epochs must be at least 1 (or None for endless), not {epochs}")
        self.plan = plan
        self.batch_size = batch_size
        self.epochs = epochs
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.rank, self.world_size = rank, world_size
        self._retries_before = retry_count()
        self.source = open_source(
            plan, tokenize=tokenize, on_bad_sample=on_bad_sample, bad_sample_budget=bad_sample_budget
        )
        self.drop_remainder = drop_remainder
        self.epochs_of = Epochs(
            self.source,
            name=plan.name,
            seed=plan.seed,
            shuffle=shuffle,
            rank=rank,
            world_size=world_size,
            batch_size=batch_size,
            drop_remainder=drop_remainder,
        )
        self.schedule: Schedule = self._schedule(0)
        self._warn_of_a_large_holdout()
        self.epoch = 0
        self.batch = 0  # batches delivered in the current epoch
        self._restored: dict[str, Any] | None = None
        self._worker_retries = 0
        self._iterators: weakref.WeakSet[Generator[Any, None, None]] = weakref.WeakSet()
        if os.getpid() == self.epochs_of.origin:
            _OPEN.add(self)

    def _warn_of_a_large_holdout(self) -> None:
        held, plan = self.plan.holdout_records, self.plan
        if not held or plan.from_holdout or not hasattr(self.source, "total"):
            return
        if plan.samples_exact and plan.samples is not None:
            total = plan.samples
        elif self.source.random_access:
            total = self.source.total()
        else:
            return  # a stream without counts is not counted here just to warn

        if held > HOLDOUT_SHARE * total:
            log.warning(
                "%s: the validation holdout takes %d of %d records (%.0f%%): val_batches %d x batch size %d. "
                "Training reads the other %d. Set loading.val_batches lower (0 for none), or val_split to a split "
                "of its own",
                plan.name,
                held,
                total,
                100 * held / total,
                plan.loading.val_batches,
                plan.batch_size,
                max(total - held, 0),
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.plan.name!r}, batch_size={self.batch_size}, rank={self.rank}/{self.world_size}, "
            f"workers={self.num_workers}, {self.schedule.batches} batches/epoch)"
        )

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self.schedule.batches

    @property
    def retries(self) -> int:
        """Transient storage errors retried since this loader was opened, here and in its workers."""
        return retry_count() - self._retries_before + self._worker_retries

    @property
    def ledger(self) -> Ledger:
        """The bad-sample ledger of this loader (counts, skipped samples, summary())."""
        return self.source.ledger

    def _schedule(self, epoch: int) -> Schedule:
        return self.epochs_of.schedule(epoch)

    def __iter__(self) -> Iterator[Any]:
        iterator = self._iterate()
        self._iterators.add(iterator)
        atexit.unregister(_close_open_loaders)
        atexit.register(_close_open_loaders)
        return iterator

    def _close_iterators(self) -> None:
        for iterator in list(self._iterators):
            iterator.close()

    def _iterate(self) -> Generator[Any, None, None]:
        while self.epochs is None or self.epoch < self.epochs:
            self.schedule = self._schedule(self.epoch)
            # Starting worker processes takes a second or more (grain's spawned workers import jax
            # again): this process builds the first batch itself meanwhile, and the workers start
            # one batch later. Any process builds a batch alike, so nothing else changes.
            head = self.num_workers > 0 and self._cold(self.epoch, self.batch) and self.source.random_access
            head = head and self.batch < self.schedule.batches
            outputs = self._batches(self.epoch, self.batch + 1 if head else self.batch)
            try:
                for _ in range(self.batch, self.schedule.batches):
                    output = self._head(self.epoch, self.batch) if head else next(outputs, None)
                    head = False
                    if output is None:
                        raise DatacatError(
                            f"{self.plan.name}: the workers stopped after {self.batch} of {self.schedule.batches} "
                            f"batches of epoch {self.epoch}; this is a datacat bug, please report it"
                        )
                    for mark in output["marks"]:
                        self.source.ledger.admit(mark)  # raises, or records a skip
                    self.source.ledger.seen += len(output["batch"]["key"])
                    self._worker_retries += output.get("retries", 0)
                    self.batch += 1
                    yield self._finish(output["batch"])
            finally:
                close = getattr(outputs, "close", None)
                if close is not None:
                    close()
            self.epoch += 1
            self.batch = 0
            self._restored = None
        self._finished()

    def _finished(self) -> None:
        """Every epoch delivered: the workers are not needed again (a backend may stop them without waiting)."""
        self.close()

    def close(self) -> None:
        """Stops this loader's worker processes (they live across epochs); iterating again starts new ones."""

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _batches(self, epoch: int, first: int) -> Iterator[dict[str, Any]]:
        raise NotImplementedError

    def _cold(self, epoch: int, first: int) -> bool:
        """Whether reading from ``(epoch, first)`` starts worker processes slowly (spawned, or from a forkserver)."""
        return False

    def _head(self, epoch: int, first: int) -> dict[str, Any]:
        """Batch ``first`` of ``epoch``, built in this process while the workers start."""
        batches = self._in_process(epoch, first)
        try:
            return next(batches)
        finally:
            batches.close()

    def _in_process(self, epoch: int, first: int) -> Generator[dict[str, Any], None, None]:
        """The batches of ``epoch`` from ``first`` on, built in this process (no workers)."""
        batches = self.epochs_of.batches(epoch)
        try:
            for index in range(first, len(batches)):
                yield batches[index]
        finally:
            batches.close()  # its read-ahead thread

    def _finish(self, batch: dict[str, Any]) -> Any:
        return batch

    def _backend_state(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is, as a small JSON-able dict; ``load_state_dict`` continues from it."""
        return {
            "version": STATE_VERSION,
            "plan": self.plan.name,
            "fingerprint": self.plan.fingerprint(),
            "framework": self.framework,
            "epoch": self.epoch,
            "batch": self.batch,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "drop_remainder": self.drop_remainder,
            "shuffle": self.shuffle,
            "num_workers": self.num_workers,
            "records": self.schedule.records,
            "ledger": self.source.ledger.state(),
            "backend": self._backend_state(),
        }

    def load_state_dict(self, state: dict[str, Any], *, allow_other_plan: bool = False) -> None:
        """Continues from ``state``: the next batch is the one after the last batch it had delivered.

        A state saved for another Plan (other shards, weights, seed, options)
        or another world layout is refused, unless ``allow_other_plan=True``.
        """
        if state.get("version") != STATE_VERSION:
            raise PlanMismatch(
                f"loader state version {state.get('version')!r} is not {STATE_VERSION}; it was saved by another datacat"
            )
        mine = self.state_dict()
        differences = [
            f"{key}: saved {state.get(key)!r}, this loader {mine[key]!r}"
            for key in ("fingerprint", "rank", "world_size", "batch_size", "drop_remainder", "shuffle")
            if state.get(key) != mine[key]
        ]
        schedule = self._schedule(int(state["epoch"]))
        if state.get("records", schedule.records) != schedule.records:
            differences.append(
                f"records in epoch {state['epoch']}: saved {state['records']}, this loader {schedule.records}"
            )
        if not self.source.random_access and state.get("num_workers") != self.num_workers:
            differences.append(
                f"num_workers: saved {state.get('num_workers')}, this loader {self.num_workers} (a stream format's order depends on it)"
            )
        if differences and not allow_other_plan:
            raise PlanMismatch(
                f"this state was saved for a different loader of {state.get('plan')!r}: {'; '.join(differences)}. "
                "Pass allow_other_plan=True to load it anyway."
            )
        if differences:
            log.warning("loading a state saved for a different loader: %s", "; ".join(differences))
        if not 0 <= int(state["batch"]) <= schedule.batches:
            raise PlanMismatch(
                f"saved batch {state['batch']} is outside this loader's {schedule.batches} batches in that epoch"
            )
        self.schedule = schedule
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])
        self.source.ledger.restore(state["ledger"])
        self._restored = state.get("backend") or None
