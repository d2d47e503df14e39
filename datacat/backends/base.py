"""The epoch loop both backends share: batches in schedule order, their markers through the ledger, resumable.

A backend supplies only ``_batches(epoch, first)``: the outputs of that
epoch's ``BatchView`` from batch ``first`` on, in batch order, computed in
its own worker processes (each worker builds whole batches: one message per
batch; ``Epochs`` lets a worker build any epoch's view itself, so workers
live across epochs), and ``_finish`` to turn a collated numpy batch into its
framework's batch.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import weakref
from collections.abc import Generator
from typing import Any, Self

from datacat.errors import DatacatError, PlanMismatch
from datacat.loading.contracts import Batch
from datacat.loading.epochs import Schedule
from datacat.loading.filling import fills_in_process
from datacat.loading.mixture import open_source
from datacat.loading.options import LoadOptions
from datacat.loading.runs import Epochs
from datacat.loading.sources import SampleSource
from datacat.loading.state import STATE_VERSION, differences
from datacat.plan import Plan
from datacat.storage import retry_count
from datacat.storage.shard_fill import Filler, wanted_shards
from datacat.transforms.ledger import Ledger

__all__ = ["BaseLoader"]

log = logging.getLogger(__name__)
ELASTIC = ("rank", "world_size", "batch_size")
"""What a state may differ in and still be continued from, for random access formats (global steps)."""
HOLDOUT_SHARE = 0.1
"""A holdout over this share of the records is warned of: a default meant for millions met a small set."""
Outputs = Generator[dict[str, Any], None, None]
"""A backend's BatchView outputs of one epoch, in batch order."""


_OPEN: weakref.WeakSet[BaseLoader] = weakref.WeakSet()  # loaders of this process, closed at its exit


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


class BaseLoader:
    """Batches of one Plan for one rank, epoch after epoch, resumable from ``state_dict()``: a :class:`~datacat.loading.contracts.Loader`.

    Every record of the split is delivered once per epoch across ranks and
    workers; every rank gets the same number of batches (see
    :mod:`datacat.loading.epochs`). A batch holds the records its schedule assigns,
    less any that the ``skip`` policy dropped.
    """

    framework = ""

    def __init__(self, plan: Plan, options: LoadOptions) -> None:
        self.plan = plan
        self.options = options
        self.batch_size = options.batch_size
        self.epochs = options.epochs
        self.shuffle, self.shuffle_run = options.shuffle, options.shuffle_run
        self.rank, self.world_size = options.place
        self._retries_before = retry_count()
        self.source = open_source(plan, options)
        self.num_workers = options.num_workers
        if self.num_workers and fills_in_process(self.source):
            log.info(
                "%s: its batches are gathered by two threads of this process; %d worker processes would only "
                "copy them once more, so none are started",
                plan.name,
                self.num_workers,
            )
            self.num_workers = 0
        self.drop_remainder = options.drop_remainder
        self.epochs_of = Epochs(self.source, options, name=plan.name, seed=plan.seed)
        self.schedule: Schedule = self._schedule(0)
        self._warn_of_a_large_holdout()
        self.epoch = 0
        self.batch = 0  # batches delivered in the current epoch
        self._restored: dict[str, Any] | None = None
        self._worker_retries = 0
        self._iterators: weakref.WeakSet[Generator[Batch, None, None]] = weakref.WeakSet()
        self.filler: Filler | None = None
        """What fills the shard cache with this loader's shards (from the first iteration on), if it has one."""
        if os.getpid() == self.epochs_of.origin:
            _OPEN.add(self)

    def _warn_of_a_large_holdout(self) -> None:
        held, plan, source = self.plan.holdout_records, self.plan, self.source
        if not held or plan.from_holdout or not isinstance(source, SampleSource):  # a mixture holds out nothing
            return
        if plan.samples_exact and plan.samples is not None:
            total = plan.samples
        elif source.random_access:
            total = source.total()
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

    def __iter__(self) -> Generator[Batch, None, None]:
        iterator = self._iterate()
        self._iterators.add(iterator)
        atexit.unregister(_close_open_loaders)
        atexit.register(_close_open_loaders)
        return iterator

    def _close_iterators(self) -> None:
        for iterator in list(self._iterators):
            iterator.close()

    def _fill_shard_cache(self) -> None:
        """Starts downloading this loader's remote shards into its shard cache, once; it runs while the loader lives.

        Not stopped by ``close``: a loader closed after its epochs still
        leaves the host's cache filled for the next one.
        """
        cache = self.options.shard_cache
        if cache is None or self.filler is not None or not self.source.remote:
            return
        self.filler = Filler(cache, wanted_shards(self.plan), name=self.plan.name).start()
        weakref.finalize(self, self.filler.stop, 1.0)

    def _iterate(self) -> Generator[Batch, None, None]:
        self._fill_shard_cache()
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
                outputs.close()
            self.epoch += 1
            self.batch = 0
            self._restored = None
        self._finished()

    def _finished(self) -> None:
        """Every epoch delivered: the workers are not needed again (a backend may stop them without waiting)."""
        self.close()

    def close(self) -> None:
        """Stops this loader's worker processes (they live across epochs); iterating again starts new ones."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _batches(self, epoch: int, first: int) -> Outputs:
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
        """The batches of ``epoch`` from ``first`` on, built in this process (no workers).

        As the last batches are taken, the next epoch's first are already
        being read (:meth:`~datacat.loading.runs.Epochs.prepare`), so the read
        threads never wait at an epoch's edge.
        """
        batches = self.epochs_of.batches(epoch)
        batches.plan_reads(range(first, len(batches)))
        following = self.num_workers == 0 and self.source.random_access
        following = following and (self.epochs is None or epoch + 1 < self.epochs)
        done = False
        try:
            for index in range(first, len(batches)):
                if following and index + batches.read_ahead >= len(batches):
                    self.epochs_of.prepare(epoch + 1)
                    following = False
                done = index + 1 == len(batches)
                yield batches[index]
        finally:
            batches.close()  # its read-ahead thread
            if not done:  # left before the last batch: the next epoch is not coming
                self.epochs_of.close()

    def _finish(self, batch: dict[str, Any]) -> Batch:
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
            "shuffle_run": self.shuffle_run,
            "num_workers": self.num_workers,
            "records": self.schedule.records,
            # The global sequence position all ranks have reached: a run on another world size resumes here.
            "position": self.schedule.position(self.batch) if self.schedule.elastic else None,
            "first": self.schedule.first,  # where this epoch's batches began, when it was resumed elastically
            "ledger": self.source.ledger.state(),
            "backend": self._backend_state(),
        }

    def load_state_dict(self, state: dict[str, Any], *, allow_other_plan: bool = False) -> None:
        """Continues from ``state``: the next batch is the one after the last batch it had delivered.

        A state saved on another world size or per-rank batch size continues
        a random access format's epoch where every rank had reached (its
        global sequence position), with exactly the records not yet
        delivered (elastic resume). A state saved for another Plan (other
        shards, weights, seed, options), or another world layout of a stream
        format, is refused unless ``allow_other_plan=True``.
        """
        if state.get("version") == STATE_VERSION:
            self._resume_at(int(state["epoch"]), int(state.get("first") or 0))
        schedule = self._schedule(int(state["epoch"])) if state.get("version") == STATE_VERSION else self.schedule
        found = differences(state, self.state_dict(), records=schedule.records, stream=not self.source.random_access)
        relaid = [line for line in found if line.split(":")[0] in ELASTIC]
        if relaid and len(relaid) == len(found):
            if self.source.bucketing is not None:
                raise PlanMismatch(
                    f"this state was saved with another world layout ({'; '.join(relaid)}), and {self.plan.name!r} "
                    "cuts its epochs into aspect-ratio buckets by world size and batch size: resume on the saved ones"
                )
            if not self.source.random_access or state.get("position") is None:
                raise PlanMismatch(
                    f"this state was saved with another world layout ({'; '.join(relaid)}), and {self.plan.name!r} "
                    "is read front to back per rank: resume on the saved world size and batch size, or convert "
                    "it to ArrayRecord (datacat convert) to resume on any"
                )
            self._resume_elsewhere(state, relaid)
            return
        if found and not allow_other_plan:
            raise PlanMismatch(
                f"this state was saved for a different loader of {state.get('plan')!r}: {'; '.join(found)}. "
                "Pass allow_other_plan=True to load it anyway."
            )
        if found:
            log.warning("loading a state saved for a different loader: %s", "; ".join(found))
        if not 0 <= int(state["batch"]) <= schedule.batches:
            raise PlanMismatch(
                f"saved batch {state['batch']} is outside this loader's {schedule.batches} batches in that epoch"
            )
        self.schedule = schedule
        self.epoch = int(state["epoch"])
        self.batch = int(state["batch"])
        self.source.ledger.restore(state["ledger"])
        self._restored = state.get("backend") or None

    def _resume_at(self, epoch: int, first: int) -> None:
        # Epoch ``epoch``'s batches begin at sequence position ``first`` (0: its start).
        resumed = (epoch, first) if first else None
        if resumed != self.epochs_of.resumed:
            self.close()  # workers hold the schedules they were started with
            self.epochs_of.resumed = resumed

    def _resume_elsewhere(self, state: dict[str, Any], relaid: list[str]) -> None:
        # Elastic: this rank's schedule of the saved epoch from the saved global position, from batch 0.
        epoch, position = int(state["epoch"]), int(state["position"])
        self._resume_at(epoch, position)
        self.schedule = self._schedule(epoch)
        self.epoch, self.batch = epoch, 0
        self.source.ledger.restore(state["ledger"])
        self._restored = None
        log.info(
            "%s: resuming epoch %d at record %d of %d on another layout (%s)",
            self.plan.name,
            epoch,
            position,
            self.schedule.records,
            "; ".join(relaid),
        )
