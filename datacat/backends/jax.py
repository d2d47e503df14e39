"""The jax backend: this rank's batches as a grain ``MapDataset`` source, prefetched in grain worker processes.

For random access formats the source is every batch of every epoch from
where the loader starts (``EpochRun``: element ``i`` is a batch of some
epoch, built by that epoch's BatchView, which already holds the epoch's
global shuffle from the seed), so one pool of grain workers serves all
epochs, interleaved (the same order for any worker count), and resuming is
starting the run at the saved epoch and batch. The shared transform and
collation run inside the workers. A stream format (gzip tars) gets one
source per epoch, split into consecutive runs so each worker reads its
shards front to back, and resumes through grain's ``get_state``/``set_state``.
Grain workers exit when the process that started them dies.
Without workers, batches a format fills straight into their buffers (pre-resized pixels,
embedding rows) are read by the BatchView's own threads, with no grain in
between.

Batches are dicts of numpy arrays, or with ``device_put=True`` global
``jax.Array`` s laid out over the local devices (the VQGAN example's
"superbatch", done by ``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import multiprocessing
import os
import re
import sys
import threading
import weakref
from typing import Any

# This module is the jax backend; nothing else in datacat imports jax or grain. grain is imported where a
# run first needs it (~0.1 s): batches filled by the BatchView's own threads never do.
import jax
import numpy as np

from datacat.backends import batch_memory
from datacat.backends.base import BaseLoader, Outputs
from datacat.backends.malloc import keep_freed_memory
from datacat.errors import OptionError
from datacat.loading.collate import array_keys
from datacat.loading.filling import fills_in_process
from datacat.loading.options import JaxOptions, LoadOptions
from datacat.loading.runs import EpochRun
from datacat.plan import Plan

__all__ = ["JaxLoader", "open_jax"]


def _mark_flags_parsed() -> None:
    # grain's worker processes crash on unparsed absl flags (grain issue #1355, unfixed in 0.2.18).
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


_GUARD = re.compile(r"""^\s*if\s+__name__\s*==\s*['"]__main__['"]""", re.MULTILINE)
_UNGUARDED = (
    "grain starts its worker processes by spawning them, and a spawned process runs the script's top level "
    'again: put the code that opens the loader under `if __name__ == "__main__":` (or pass num_workers=0)'
)


def _unguarded_script() -> bool:
    """Whether ``__main__`` is a script file with no ``if __name__ == "__main__":`` guard."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            return _GUARD.search(source.read()) is None
    except OSError:
        return False


def _spawned_and_starting() -> bool:
    # A spawned child imports the parent's main module as __mp_main__ before it runs its task.
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


class _Sealed:
    """A batch as grain carries it in this process: one leaf, where the batch's dict is a tree whose every key and
    caption string grain's byte counts and output specs visit (~0.4 ms a batch of 1024 rows, under the GIL the
    filling threads need). Workers' batches stay dicts: grain moves their arrays through shared memory."""

    __slots__ = ("output",)

    def __init__(self, output: dict[str, Any]) -> None:
        self.output = output


class _SealedBatches:
    """Batches by index, each sealed: what grain's source reads when there are no workers."""

    def __init__(self, batches: Any) -> None:
        self.batches = batches  # an EpochRun or a BatchView

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> _Sealed:
        return _Sealed(self.batches[index])


def _unsealed(item: Any) -> dict[str, Any]:
    return item.output if isinstance(item, _Sealed) else item


def _take_first(iterator: Any, future: concurrent.futures.Future[dict[str, Any]]) -> None:
    try:
        future.set_result(_unsealed(next(iterator)))
    except BaseException as exc:  # handed to the loop that waits for it, whatever it is
        future.set_exception(exc)


def _stop(iterator: Any, slots: batch_memory.Slots | None) -> None:
    """Stops a run's workers (grain's close() frees the batches in flight), then unlinks what they never sent."""
    if iterator is not None:
        iterator.close()
    if slots is not None:
        slots.close()


def _stop_in_thread(iterator: Any, slots: batch_memory.Slots | None) -> threading.Thread:
    """Stops a run in a thread of its own, joined at exit before multiprocessing's own hooks run."""
    stopping = threading.Thread(target=_stop, args=(iterator, slots), name="datacat-grain-stop", daemon=True)
    stopping.start()
    atexit.register(stopping.join)
    return stopping


def _start_worker(parent: int, slots: tuple[str, int] | None, worker_index: int, worker_count: int) -> None:
    # grain spawns its workers; a parent killed by SIGKILL would leave them waiting forever.
    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="datacat-parent-watch", daemon=True).start()
    keep_freed_memory()
    if slots is not None:
        batch_memory.worker_slots(*slots, worker_index)


class JaxLoader(BaseLoader):
    """Batches as dicts of numpy arrays (or ``jax.Array`` with ``device_put=True``)."""

    framework = "jax"

    def __init__(self, plan: Plan, options: LoadOptions, jax_options: JaxOptions | None = None) -> None:
        if options.num_workers > 0 and _spawned_and_starting():
            raise SystemExit(
                f"datacat: {_UNGUARDED}"
            )  # a worker re-running an unguarded script: one line, no traceback
        super().__init__(plan, options)
        jax_options = jax_options or JaxOptions()
        self.read_threads = jax_options.read_threads
        self.device_put = jax_options.device_put or jax_options.sharding is not None
        self.arrays = array_keys(plan)  # the batch keys placed on the devices, once per loader
        self.sharding = jax_options.sharding
        self._iterator: Any = None
        self._next: tuple[int, int] | None = None  # the (epoch, batch) self._iterator yields next
        self._first: concurrent.futures.Future[dict[str, Any]] | None = None  # its first output, asked early
        self._boot: threading.Thread | None = None  # the thread that asks for it, until started
        self._slots: batch_memory.Slots | None = None  # the run's reusable batch memory in its workers
        self._stopping: list[threading.Thread] = []  # finished runs' workers, stopping
        self._dropped: weakref.finalize[Any, JaxLoader] | None = None  # stops the run of a loader dropped unclosed
        if self.num_workers > 0:
            self.epochs_of.allocate = batch_memory.take  # a worker's slot when it has one free
        if self.device_put:
            devices = jax.local_device_count()
            if self.sharding is None:
                # A 1-D mesh over every process's devices, each process's together and in process order: a batch
                # is one global array whose rows are rank 0's records, then rank 1's, ... (one global step), each
                # process contributing its own to the shards it addresses.
                everywhere = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
                mesh = jax.sharding.Mesh(np.array(everywhere), ("data",))
                self.sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))  # type: ignore[no-untyped-call]
            if jax.process_count() > 1 and len(set(self.schedule.batch_sizes)) > 1:
                raise OptionError(
                    f"{plan.name}: a global jax array over {jax.process_count()} processes needs every process's "
                    f"batches of one size; this schedule has batches of {sorted(set(self.schedule.batch_sizes))}. "
                    "Pass drop_remainder=True"
                )
            if any(size % devices for size in self.schedule.batch_sizes):
                raise OptionError(
                    f"{plan.name}: jax arrays split over {devices} local device(s) need every batch size divisible by it; "
                    f"this schedule has batches of {sorted(set(self.schedule.batch_sizes))}. Pass drop_remainder=True "
                    "and a batch_size divisible by the device count"
                )

    def _batches(self, epoch: int, first: int) -> Outputs:
        if not self.source.random_access:
            return self._stream_epoch(epoch, first)
        if self.num_workers == 0 and fills_in_process(self.source):
            # Filled by the BatchView's own threads (pre-resized pixels, embedding rows), which already build
            # the next two batches while one is taken: a grain reader thread on top only handed each over once
            # more, holding the GIL the filling threads need. (Colour jitter, per-image work after the fill,
            # keeps grain's thread, which overlaps it with the training step.)
            return self._in_process(epoch, first)
        import grain

        if self._iterator is None or self._next != (epoch, first):
            # First epoch, or the last one was left early: a new run from here.
            self.close()
            run = EpochRun(self.epochs_of, epoch, first, None if self.epochs is None else self.epochs)
            if self.num_workers > 0 and batch_memory.available():
                self._slots = batch_memory.Slots(self.num_workers)
            source = (
                grain.MapDataset.source(run).map(batch_memory.hand_over)
                if self.num_workers
                else grain.MapDataset.source(_SealedBatches(run))
            )
            self._iterator = iter(self._prefetched(source, sequential=False))
            self._dropped = weakref.finalize(self, _stop_in_thread, self._iterator, self._slots)
            self._dropped.atexit = False  # a loader still open at exit is closed by base's exit hook
            self._next = (epoch, first) if first < self.schedule.batches else (epoch + 1, 0)
            if self.num_workers > 0 and first < self.schedule.batches:
                # grain starts its workers on the first next(): asked for in a thread once this process has
                # built the first batch itself (Loader.__iter__), so the workers boot (importing jax again)
                # while the user takes it, and do not slow the first batch down.
                self._first = concurrent.futures.Future()
                self._boot = threading.Thread(target=_take_first, args=(self._iterator, self._first), daemon=True)
        return self._from_run(epoch, first)

    def _head(self, epoch: int, first: int) -> dict[str, Any]:
        try:
            return super()._head(epoch, first)
        finally:
            self._start_workers()

    def _start_workers(self) -> None:
        boot, self._boot = self._boot, None
        if boot is not None:
            boot.start()

    def _from_run(self, epoch: int, first: int) -> Outputs:
        batches = self.schedule.batches
        self._start_workers()  # if no first batch was built here
        for index in range(first, batches):
            try:
                if self._first is not None:
                    pending, self._first = self._first, None
                    output = pending.result()
                else:
                    output = _unsealed(next(self._iterator))
            except Exception:  # sorted here: the workers of an unguarded script die starting; other errors propagate
                if self.num_workers > 0 and _unguarded_script():
                    self.close()
                    raise OptionError(f"{self.plan.name}: {_UNGUARDED}") from None
                raise
            self._next = (epoch, index + 1) if index + 1 < batches else (epoch + 1, 0)
            yield output

    def _stream_epoch(self, epoch: int, first: int) -> Outputs:
        import grain

        batches = self.epochs_of.batches(epoch)
        iterator = None
        try:
            iterator = iter(
                self._prefetched(
                    grain.MapDataset.source(_SealedBatches(batches) if not self.num_workers else batches),
                    sequential=True,
                )
            )
            saved = (self._restored or {}).get("grain")
            if first and saved is not None:
                iterator.set_state(saved)
            elif first:
                for _ in range(first):  # no grain state to restore (another worker count): read past
                    next(iterator)
            self._iterator = iterator
            for item in iterator:
                yield _unsealed(item)
        finally:
            self._iterator = None
            if iterator is not None:
                iterator.close()  # its workers stop now, not when it is collected
            batches.close()

    def _prefetched(self, source: Any, *, sequential: bool) -> Any:
        import grain

        # One reader thread per process: a batch is already a unit of work, and more
        # threads would only contend for the two cores with the worker processes.
        # grain's reader builds up to prefetch_buffer_size (default 500) elements ahead,
        # taken or not: 500 batches of ~12 MB a worker under a training step slower than
        # loading. A worker's reader builds the next batch while the last is handed over;
        # grain holds 4 more a worker on their way (the worker's hand, its queue, and this
        # process's reader thread of it, holding one and buffering one).
        ahead = self.read_threads if self.num_workers > 0 else max(2, self.read_threads)
        dataset = source.to_iter_dataset(grain.ReadOptions(num_threads=self.read_threads, prefetch_buffer_size=ahead))
        if self.num_workers > 0:
            _mark_flags_parsed()
            dataset = dataset.mp_prefetch(
                grain.multiprocessing.MultiprocessingOptions(num_workers=self.num_workers),
                worker_init_fn=functools.partial(
                    _start_worker, os.getpid(), None if self._slots is None else self._slots.worker_args
                ),
                sequential_slice=sequential,
            )
        return dataset

    def _cold(self, epoch: int, first: int) -> bool:
        return self._iterator is None or self._next != (epoch, first)

    def _detach(self) -> tuple[Any, batch_memory.Slots | None]:
        # Dropping the iterator is not enough to stop the workers: the thread that asked for its
        # first batch may still hold it.
        iterator, slots = self._iterator, self._slots
        self._iterator, self._next, self._first, self._boot, self._slots = None, None, None, None, None
        if self._dropped is not None:
            self._dropped.detach()
            self._dropped = None
        return iterator, slots

    def _finished(self) -> None:
        # grain stops its workers one after another, each noticing within 0.5 s: the loop ends now, and
        # they stop in a thread (joined by close(), and at exit before multiprocessing's own hooks).
        iterator, slots = self._detach()
        if iterator is not None or slots is not None:
            self._stopping.append(_stop_in_thread(iterator, slots))

    def close(self) -> None:
        _stop(*self._detach())
        for stopping in self._stopping:
            stopping.join()
            atexit.unregister(stopping.join)
        self._stopping = []

    def _backend_state(self) -> dict[str, Any]:
        if self._iterator is None or self.batch == 0 or self.source.random_access:
            return {}  # a run restarts at the saved epoch and batch
        return {"grain": self._iterator.get_state()}

    def _finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        for key, value in batch.items():
            if isinstance(value, batch_memory.SlotRef):
                assert self._slots is not None, "a slot's batch outside the run that made it"
                batch[key] = self._slots.receive(value)
            # grain hands other arrays over in shared memory; give the user plain arrays and free the segments.
            elif isinstance(value, np.ndarray) and type(value) is not np.ndarray:
                batch[key] = batch_memory.plain(value)
                if hasattr(value, "unlink_on_del"):
                    value.unlink_on_del()  # grain's array, deleted now, unlinks the segment's name
        if self.device_put:
            for key in self.arrays:
                if key in batch:
                    batch[key] = jax.make_array_from_process_local_data(self.sharding, batch[key])  # type: ignore[no-untyped-call]
        return batch


def open_jax(plan: Plan, options: LoadOptions, jax_options: JaxOptions | None = None) -> JaxLoader:
    """A JaxLoader for ``plan``; rank and world size default to jax's process index and count."""
    if options.rank is None or options.world_size is None:
        options = options.placed(jax.process_index(), jax.process_count())
    return JaxLoader(plan, options, jax_options)
