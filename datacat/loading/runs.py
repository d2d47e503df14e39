"""Epochs cut into batches: one rank's epochs of a source, and a run of them read as one sequence by workers.

Both are picklable, so each worker process of either backend builds any
epoch's :class:`~datacat.loading.batches.BatchView` itself: workers live
across epochs, and a pool of them crosses from one epoch into the next.
"""

from __future__ import annotations

import bisect
import os
from typing import Any

from datacat.loading.batches import Allocate, BatchView
from datacat.loading.contracts import Source
from datacat.loading.epochs import Schedule, plan_schedule
from datacat.loading.options import LoadOptions
from datacat.loading.pace import Pace

__all__ = ["ENDLESS", "EpochRun", "Epochs"]

ENDLESS = 1 << 48
"""The length of an endless EpochRun (grain needs a length)."""


class Epochs:
    """One rank's epochs of one source, cut into batches: picklable, so a worker builds any epoch's view.

    ``batches(epoch)`` is the same ``BatchView`` in every process, since
    everything it depends on (source, seed, rank, batch size) is here.
    """

    def __init__(self, source: Source, options: LoadOptions, *, name: str, seed: int) -> None:
        self.source = source  # a SampleSource or MixtureSource
        self.name, self.seed, self.shuffle = name, seed, options.order
        self.rank, self.world_size = options.place
        self.batch_size, self.drop_remainder = options.batch_size, options.drop_remainder
        self.origin = os.getpid()  # the loader's process: workers report their retries to it
        self.resumed: tuple[int, int] | None = None  # (epoch, sequence position) an elastic resume starts from
        self.allocate: Allocate | None = None  # where batches are collated; a backend may give shared memory
        self.pace = Pace()  # this process's reads against its loop, from one epoch's view to the next
        self._ready: tuple[tuple[int, tuple[int, int] | None], BatchView] | None = None  # a view already reading

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ready": None}  # its reads belong to this process

    def __repr__(self) -> str:
        return f"Epochs({self.name!r}, rank={self.rank}/{self.world_size}, batch_size={self.batch_size})"

    def schedule(self, epoch: int) -> Schedule:
        """Which records of epoch ``epoch`` this rank reads, in which batches (from the resume point, if resumed there)."""
        resumed = self.resumed
        first = resumed[1] if resumed is not None and resumed[0] == epoch else 0
        if self.source.bucketing is not None:
            return self.source.bucketing.schedule(
                self.seed,
                epoch,
                shuffle=bool(self.shuffle),
                rank=self.rank,
                world_size=self.world_size,
                batch_size=self.batch_size,
                drop_remainder=self.drop_remainder,
                first=first,
            )
        return plan_schedule(
            self.source.epoch_length(self.seed, epoch),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self.batch_size,
            drop_remainder=self.drop_remainder,
            name=self.name,
            steps=self.source.random_access,
            first=first,
        )

    def batches(self, epoch: int) -> BatchView:
        """This rank's batches of epoch ``epoch``, by batch index (the one :meth:`prepare` started, if it did)."""
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == (epoch, self.resumed):
            return ready[1]
        if ready is not None:
            ready[1].close()
        view = self.source.view(self.schedule(epoch), seed=self.seed, epoch=epoch, shuffle=self.shuffle)
        return BatchView(view, origin=self.origin, allocate=self.allocate, pace=self.pace)

    def prepare(self, epoch: int) -> None:
        """Starts reading epoch ``epoch``'s first batches in this process's read threads; ``batches(epoch)`` takes them.

        Called while the last batches of the epoch before are taken, so the
        read threads cross into the next epoch without a pause: otherwise its
        first batch is read only when asked for, and its second after that
        (with batches of 64 pre-resized images, two of fifteen an epoch read
        by one thread where two fill side by side).
        """
        if self._ready is None or self._ready[0] != (epoch, self.resumed):
            view = self.batches(epoch)
            view.plan_reads(range(len(view)))
            view.start()
            self._ready = ((epoch, self.resumed), view)

    def close(self) -> None:
        """Stops the reads :meth:`prepare` started."""
        ready, self._ready = self._ready, None
        if ready is not None:
            ready[1].close()


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
            return ENDLESS
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
