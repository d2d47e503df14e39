"""The torch backend: each epoch's BatchView served through ``torch.utils.data.DataLoader`` worker processes.

Each worker builds whole batches of this rank's slice (random access
formats: every ``num_workers``-th batch, so the merged order is the same for
any worker count; stream formats: one contiguous run of batches each, read
front to back), and the main process takes them in order. A worker resizes
a batch's images into one of a few shared-memory arrays of its own and
sends only its name; it fills the array again once the main process holds
no tensor of it (:mod:`~datacat.backends.batch_memory`: no fresh pages to
allocate and zero, no file descriptor to pass, for every batch). The
workers live across epochs
(``persistent_workers``): the main process writes where a run starts (epoch,
first batch, last epoch) into a small shared array, and each worker builds
each epoch's view itself from the pickled ``Epochs``. A random access run
spans every epoch to the last, so workers go on into the next epoch while
the main process takes the last batches of this one (a reset at each epoch
would leave a core idle at every epoch's end).
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.context
import os
import sys
import weakref
from collections.abc import Generator, Iterator
from typing import Any

# This module is the torch backend; nothing else in datacat imports torch.
import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from datacat.backends import batch_memory
from datacat.backends.base import BaseLoader, Outputs
from datacat.backends.malloc import keep_freed_memory
from datacat.errors import DatacatError, OptionError
from datacat.loading.batches import BatchView
from datacat.loading.collate import array_keys, field_keys
from datacat.loading.epochs import round_robin_consumed
from datacat.loading.options import LoadOptions, TorchOptions
from datacat.loading.runs import EpochRun, Epochs
from datacat.plan import Plan
from datacat.registry import format_of

__all__ = ["TorchLoader", "open_torch", "worker_indices"]


def worker_indices(length: int, start: int, workers: int, worker: int, *, sequential: bool) -> range:
    """The batch indices DataLoader worker ``worker`` of ``workers`` builds, from ``start`` on.

    Interleaved (``sequential=False``): the merged round-robin order is
    ``start, start+1, ...`` for any worker count. Sequential: each worker a
    contiguous run of ``[0, length)``, resumed where round-robin left it, the
    worker whose turn it was going first (DataLoader always asks worker 0
    first).
    """
    if not sequential:
        return range(start + worker, length, workers)
    bounds = [length * k // workers for k in range(workers + 1)]
    lengths = [bounds[k + 1] - bounds[k] for k in range(workers)]
    done = round_robin_consumed(lengths, start)
    after = round_robin_consumed(lengths, min(start + 1, length))
    turn = next((k for k in range(workers) if after[k] > done[k]), 0)
    run = (turn + worker) % workers
    return range(bounds[run] + done[run], bounds[run + 1])


class _BatchStream(IterableDataset):  # type: ignore[type-arg]
    """The batches this DataLoader worker builds from where ``position`` says: ``[epoch, first, last epoch, run]``.

    Random access formats: every ``num_workers``-th batch of the run of
    epochs from there until the last (-1: endless), so the workers cross
    into the next epoch while the main process takes the last batches of
    this one. Stream formats: this worker's contiguous run of the one epoch.
    ``position`` is shared memory the main process writes before each run
    (a list when there are no workers), so one pool of workers serves them all.
    ``slots`` attaches a worker to the loader's reusable batch memory
    (:class:`~datacat.backends.batch_memory.Slots`); None: every batch's
    images are sent as a tensor.
    """

    def __init__(self, epochs: Epochs, position: Any, sequential: bool, slots: tuple[str, int] | None = None) -> None:
        self.epochs, self.position, self.sequential, self.slots = epochs, position, sequential, slots

    def __iter__(self) -> Generator[dict[str, Any], None, None]:
        global _STARTED
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, start, last, run_number = (int(value) for value in self.position[:4])
        if info is not None and not _STARTED:  # this worker's first run
            _STARTED = True
            keep_freed_memory()
            if self.slots is not None:
                batch_memory.worker_slots(*self.slots, worker)
        batch_memory.serve_run(run_number)
        if self.sequential:
            batches = self.epochs.batches(epoch)
            run: EpochRun | BatchView = batches
            indices = worker_indices(len(batches), start, workers, worker, sequential=True)
            batches.plan_reads(indices)
        else:
            run = EpochRun(self.epochs, epoch, start, None if last < 0 else last)
            run.stride(worker, workers)
            indices = range(worker, len(run), workers)
        arrays = _tensor_keys(self.epochs.source.plan)
        try:
            for index in indices:
                # images in a slot: only its name is sent; DataLoader moves the other tensors to shared memory
                yield _as_tensors(batch_memory.hand_over(run[index]), arrays)
        finally:
            run.close()  # its read-ahead thread


def _tensor_keys(plan: Plan) -> tuple[str, ...]:
    return array_keys(plan) + field_keys(plan)  # fields: when numbers


def _as_tensors(output: dict[str, Any], arrays: tuple[str, ...]) -> dict[str, Any]:
    """A BatchView output with its arrays as tensors over the same memory."""
    batch = output["batch"]
    for key in arrays:
        if isinstance(batch.get(key), np.ndarray):
            batch[key] = torch.from_numpy(batch[key])
    return output


_STARTED = False  # whether this worker process has started its first run


def _identity(item: Any) -> Any:
    return item


def _inherit_environment(environment: dict[str, str], worker_id: int) -> None:
    # A forkserver started earlier holds the environment of that moment; workers need the loader's
    # (storage endpoints, credentials, GCSFS_* switches set since).
    os.environ.update(environment)


def _worker_context(plan: Plan) -> multiprocessing.context.BaseContext | None:
    """Fork, as torch does by default, unless forking this process is known to break the workers.

    A forked worker segfaults on its first ArrayRecord read once array_record's
    C++ library has run in this process (its format says: ``used_here``), and
    may deadlock beside a started jax backend. Then the workers start from a
    forkserver (a clean process started once, torch preloaded), which needs
    the script's top level behind ``if __name__ == "__main__":``. A loader
    that reads no ArrayRecord forks whatever ran here before it.
    """
    if not _jax_started() and not _forks_badly(plan):
        return None
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "datacat.backends.torch"])
    return context


def _forks_badly(plan: Plan) -> bool:
    """Whether ``plan`` reads a format whose native library this process has loaded (a forked child would crash)."""
    if plan.components:
        return any(_forks_badly(part.plan) for part in plan.components)
    used_here = format_of(plan.format).used_here
    return used_here is not None and used_here()


def _jax_started() -> bool:
    # Importing jax (grain imports it) starts no thread; a jax backend does. Unknown means started.
    if "jax" not in sys.modules:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bridge is None or bool(getattr(bridge, "_backends", True))


def _stop_workers(workers: DataLoader | None, slots: batch_memory.Slots | None) -> None:  # type: ignore[type-arg]
    """Stops and joins the workers now, then unlinks the batch memory they never sent.

    Dropping the DataLoader would stop them only once its iterator is
    collected, which a suspended loop or a reference cycle delays: a worker
    still running could make a slot after its names were unlinked.
    """
    shutdown = getattr(getattr(workers, "_iterator", None), "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()  # torch's own, as the iterator's finaliser calls it; a second call does nothing
    if slots is not None:
        slots.close()


def _unless_stuck(batches: Iterator[dict[str, Any]], timeout: float, name: str) -> Iterator[dict[str, Any]]:
    # A worker stuck on storage would otherwise keep the main process waiting forever.
    try:
        yield from batches
    except RuntimeError as exc:
        if "timed out" not in str(exc):
            raise
        raise DatacatError(
            f"{name}: no batch came from the worker processes in {timeout:.0f} s; a worker is stuck (storage "
            "unreachable, or a shard that never ends?). Check the root and network, or raise worker_timeout="
        ) from None


def _check_picklable(stream: _BatchStream) -> None:
    # Workers that do not fork get the dataset pickled; say which part cannot be, and the fix.
    import pickle

    try:
        pickle.dumps(stream)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise OptionError(
            f"the loader cannot be pickled to worker processes that are not forked ({exc}); a tokenize= must be a "
            "module-level function or a picklable object, or pass num_workers=0"
        ) from None


class TorchLoader(BaseLoader):
    """Batches as dicts of torch tensors: ``image`` uint8 [B, H, W, 3] (or float [B, 3, H, W] in [-1, 1])."""

    framework = "torch"

    def __init__(self, plan: Plan, options: LoadOptions, torch_options: TorchOptions | None = None) -> None:
        super().__init__(plan, options)
        torch_options = torch_options or TorchOptions()
        self.image_layout = torch_options.image_layout
        self.prefetch_factor = torch_options.prefetch_factor
        self.multiprocessing_context = torch_options.multiprocessing_context
        self.worker_timeout = torch_options.worker_timeout
        self.reuse_batch_memory = reuse_batch_memory = torch_options.reuse_batch_memory
        self._workers: DataLoader | None = None  # type: ignore[type-arg]
        self._position: Any = None
        self._runs = 0  # runs started on these workers: the slot table's marks
        self._slots: batch_memory.Slots | None = None  # the workers' reusable batch memory
        self._stop: weakref.finalize[Any, TorchLoader] | None = None  # stops the workers, then frees it
        self._run: Iterator[dict[str, Any]] | None = None  # the workers' batches of the current run of epochs
        self._next: tuple[int, int] | None = None  # the (epoch, batch) self._run yields next
        if self.num_workers and reuse_batch_memory:
            self.epochs_of.allocate = batch_memory.take  # a worker's slot when it has one free

    def _batches(self, epoch: int, first: int) -> Outputs:
        sequential = not self.source.random_access
        if self.num_workers == 0:
            return self._tensors(self._in_process(epoch, first))
        if self._workers is None:
            self._workers = self._start_workers(sequential)
            # A loader dropped unclosed stops its workers, then unlinks their batch memory, in that order.
            self._stop = weakref.finalize(self, _stop_workers, self._workers, self._slots)
        if sequential:  # one epoch at a time: each worker reads its shards front to back
            return self._from_run(self._start_run(epoch, first, epoch + 1), epoch, first)
        if self._run is None or self._next != (epoch, first):
            # First epoch, or the last one was left early: a new run from here (the workers drop the old one).
            self._run = self._start_run(epoch, first, -1 if self.epochs is None else self.epochs)
        self._next = (epoch, first) if first < self.schedule.batches else (epoch + 1, 0)
        return self._from_run(self._run, epoch, first)

    def _tensors(self, outputs: Outputs) -> Outputs:
        """Outputs built in this process, their arrays as tensors (as a worker sends them)."""
        arrays = _tensor_keys(self.plan)
        try:
            for output in outputs:
                yield _as_tensors(output, arrays)
        finally:
            outputs.close()

    def _start_run(self, epoch: int, first: int, last: int) -> Iterator[dict[str, Any]]:
        self._runs += 1
        self._position[:] = [epoch, first, last, self._runs]
        run = _unless_stuck(iter(self._workers), self.worker_timeout, self.plan.name)  # type: ignore[arg-type]
        # iter() has taken (and dropped) every batch of the last run still on its way: their slots are free.
        if self._slots is not None:
            self._slots.reclaim(self._runs)
        return run

    def _from_run(self, run: Iterator[dict[str, Any]], epoch: int, first: int) -> Outputs:
        batches = self.schedule.batches
        for index in range(first, batches):
            self._next = None  # until this batch is taken: an error here leaves the run unusable
            output = next(run, None)
            if output is None:
                return  # the workers stopped early: the loop taking these batches says so
            self._next = (epoch, index + 1) if index + 1 < batches else (epoch + 1, 0)
            yield output

    def _start_workers(self, sequential: bool) -> DataLoader:  # type: ignore[type-arg]
        context = self.multiprocessing_context or _worker_context(self.plan)
        mp = multiprocessing.get_context(context) if isinstance(context, str) or context is None else context
        if context is not None and context != "fork":
            _check_picklable(_BatchStream(self.epochs_of, [0, 0, 1, 0], sequential))
        # Both tables reach every worker as it starts, so any start method works.
        self._position = mp.RawArray("q", 4)
        if self.reuse_batch_memory and batch_memory.available():
            self._slots = batch_memory.Slots(self.num_workers)
        return DataLoader(
            _BatchStream(
                self.epochs_of, self._position, sequential, None if self._slots is None else self._slots.worker_args
            ),
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_identity,
            prefetch_factor=self.prefetch_factor,
            persistent_workers=True,
            multiprocessing_context=context,
            worker_init_fn=None if context is None else functools.partial(_inherit_environment, dict(os.environ)),
            timeout=self.worker_timeout,
        )

    def _cold(self, epoch: int, first: int) -> bool:
        # Forked workers are ready in milliseconds: building a batch here too would only compete with them.
        context = self.multiprocessing_context or _worker_context(self.plan)
        return self._workers is None and context not in (None, "fork")

    def _head(self, epoch: int, first: int) -> dict[str, Any]:
        stream = _BatchStream(self.epochs_of, [epoch, first, epoch + 1, 0], not self.source.random_access).__iter__()
        try:
            return next(stream)  # as a worker sends it: tensors
        finally:
            stream.close()

    def close(self) -> None:
        if self._stop is not None:
            self._stop()  # once
        self._workers, self._run, self._next, self._slots, self._stop = None, None, None, None, None

    def _finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        image = batch.get("image")
        if isinstance(image, batch_memory.SlotRef):
            assert self._slots is not None, "a slot's batch outside the workers that made it"
            batch["image"] = torch.from_numpy(self._slots.receive(image))  # the tensor keeps the slot's array alive
        if self.image_layout == "chw_float" and "image" in batch:
            batch["image"] = batch["image"].permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
        return batch


def open_torch(plan: Plan, options: LoadOptions, torch_options: TorchOptions | None = None) -> TorchLoader:
    """A TorchLoader for ``plan``; rank and world size default from torch.distributed, then RANK/WORLD_SIZE."""
    if options.rank is None or options.world_size is None:
        options = options.placed(*_torch_world())
    return TorchLoader(plan, options, torch_options)


def _torch_world() -> tuple[int, int]:
    import os

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
