"""How a batch's images cross from a worker process to the loader's: shared memory filled again, sent by name.

Both backends' workers resize each batch's images straight into one of
``SLOTS`` shared-memory segments of their own, made once, and send a
:class:`SlotRef` naming it instead of the pixels. The loader's process maps
each segment once and gives out views of it; a table in shared memory (one
int a slot, :class:`Slots`) says which slots it still holds. A slot is free
again once the array it gave out, and every view of it, is gone: numpy
views all lead back to that one array (their ``base``), and anything else
that keeps the pixels (a memoryview, a jax buffer, a tensor made by
``torch.from_numpy``) keeps a view.

What it saves: grain copies every array a worker yields into a fresh
shared-memory segment (``copy_to_shm``), which the loader's process maps and
unlinks: per batch of 64 images at 256 px, 12 MB copied once more and 3000
pages allocated, zeroed, faulted in twice and freed (~6 % of a worker's CPU
here). Torch sends a tensor in shared memory as a file descriptor, passed
for every batch through a connection to a thread in the worker: ~0.8 ms of
CPU a batch over a name (12 µs an image, 2 workers, 64 images a batch).

Names: the loader's process makes the table; each worker makes its slots
under names derived from the table's, so the loader can unlink whatever a
stopped worker left. Each segment's name is unlinked as soon as the loader
maps it (both mappings stay); the resource tracker unlinks what a killed
process left. A worker whose loader starts its runs again (torch's workers
live across them) marks each slot with the run it filled it for, and the
loader frees the slots of earlier runs that never reached it
(:meth:`Slots.reclaim`). Nothing here imports torch, grain or jax.
"""

from __future__ import annotations

import math
import mmap
import os
import secrets
import threading
import weakref
from multiprocessing import resource_tracker
from typing import Any, NamedTuple

import numpy as np

try:
    import _posixshmem  # type: ignore[import-not-found]  # CPython's binding of shm_open, as multiprocessing.shared_memory uses
except ImportError:  # not POSIX: every batch goes through grain's own copy
    _posixshmem = None

__all__ = [
    "SLOTS",
    "SlotRef",
    "Slots",
    "WorkerSlots",
    "available",
    "hand_over",
    "plain",
    "serve_run",
    "take",
    "worker_slots",
]

SLOTS = 8
"""Reusable batch arrays a worker: those on their way (grain holds ~5, torch's ``prefetch_factor`` 4), and those the loop holds."""

_INT = np.dtype(np.int32)


def available() -> bool:
    """Whether this platform has POSIX shared memory by name (else grain's own copy carries every batch)."""
    return _posixshmem is not None


class SlotRef(NamedTuple):
    """A batch's images: the first ``shape[0]`` rows of slot ``slot``, shared memory ``name`` of ``size`` bytes."""

    name: str
    slot: int
    size: int
    shape: tuple[int, ...]


def _create(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        _posixshmem.shm_unlink(name)
        raise
    os.close(fd)
    resource_tracker.register(name, "shared_memory")  # unlinked by the tracker if every process dies first
    return mapped


def _open(name: str, size: int) -> mmap.mmap:
    fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _unlink(name: str) -> bool:
    """Unlinks ``name`` if it is there (and tells the resource tracker); whether it was."""
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:
        return False
    resource_tracker.unregister(name, "shared_memory")
    return True


class Slots:
    """The loader's side: the table its workers' slots are marked in, and the slots it holds.

    ``Slots(workers)`` makes the table; ``worker_args`` is what each worker
    needs to attach (:func:`worker_slots`); ``receive`` turns a
    :class:`SlotRef` into an array; ``close`` unlinks what is left once the
    workers have stopped.
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.name = f"/dc{os.getpid():x}{secrets.token_hex(4)}"
        self._table_memory = _create(self.name, SLOTS * workers * _INT.itemsize)
        self.table = np.frombuffer(self._table_memory, _INT)  # 0: the worker may fill it; else its run
        self._mapped: dict[str, mmap.mmap] = {}
        self._held: list[tuple[weakref.ref[np.ndarray], int]] = []
        # A loader dropped unclosed takes its names with it (not at exit, where the tracker would warn).
        self._unlink = weakref.finalize(self, _unlink_all, self.name, workers, os.getpid())

    @property
    def worker_args(self) -> tuple[str, int]:
        return self.name, self.workers

    def receive(self, ref: SlotRef) -> np.ndarray:
        """The images ``ref`` names, as a view of the slot, held until no view of it is left."""
        self.release()
        mapped = self._mapped.get(ref.name)
        if mapped is None:
            mapped = self._mapped[ref.name] = _open(ref.name, ref.size)
            _unlink(ref.name)  # both processes map it now: nothing is left behind whatever happens next
        whole = np.frombuffer(mapped, np.uint8, count=math.prod(ref.shape))
        self._held.append((weakref.ref(whole), ref.slot))
        return whole.reshape(ref.shape)  # every view of it keeps `whole` alive (its base)

    def release(self) -> None:
        """Marks free every slot whose array is gone."""
        held = []
        for array, slot in self._held:
            if array() is None:
                self.table[slot] = 0
            else:
                held.append((array, slot))
        self._held = held

    def reclaim(self, run: int) -> None:
        """Frees the slots filled for runs before ``run`` that never reached this process (a run started again)."""
        self.release()
        held = {slot for _, slot in self._held}
        for slot in range(len(self.table)):
            if 0 < self.table[slot] < run and slot not in held:
                self.table[slot] = 0

    def close(self) -> None:
        """Unlinks the table and any slot a worker made that never reached this process; the workers have stopped."""
        self._unlink()
        self._mapped.clear()  # each mapping goes once the last array of it does
        self._held = []


def _unlink_all(table: str, workers: int, owner: int) -> None:
    if os.getpid() != owner:  # a forked copy of the loader's process: the names are not its to remove
        return
    for slot in range(SLOTS * workers):
        _unlink(_slot_name(table, slot))
    _unlink(table)


def _slot_name(table: str, slot: int) -> str:
    return f"{table}s{slot}"


class WorkerSlots:
    """A worker's side: its ``SLOTS`` segments, each filled again once the loader marks it free."""

    def __init__(self, table: str, workers: int, worker: int) -> None:
        self.table_name = table
        self.table = np.frombuffer(_open(table, SLOTS * workers * _INT.itemsize), _INT)
        self.first = worker * SLOTS
        self.arrays: list[np.ndarray] = []
        self.taken: dict[int, int] = {}  # data address of a slot given out -> its index in self.arrays
        self.run = 1  # what a slot is marked with as it is filled: the loader's run this worker serves
        self.lock = threading.Lock()  # grain may read with several threads

    def take(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """An empty uint8 array of ``shape`` in a free slot (a new one while there is room); None if all are held."""
        with self.lock:
            for k, array in enumerate(self.arrays):
                if self.table[self.first + k] == 0 and array.shape[1:] == shape[1:] and len(array) >= shape[0]:
                    return self._give(k, array[: shape[0]])
            if len(self.arrays) == SLOTS:
                return None
            size = math.prod(shape)
            name = _slot_name(self.table_name, self.first + len(self.arrays))
            self.arrays.append(np.frombuffer(_create(name, _segment(size)), np.uint8, count=size).reshape(shape))
            return self._give(len(self.arrays) - 1, self.arrays[-1])

    def _give(self, k: int, array: np.ndarray) -> np.ndarray:
        self.table[self.first + k] = self.run
        self.taken[array.ctypes.data] = k
        return array

    def hand_over(self, images: Any) -> Any:
        """A :class:`SlotRef` for ``images`` if they are the head of a slot given out, else ``images`` as they are."""
        if not isinstance(images, np.ndarray):
            return images
        with self.lock:
            k = self.taken.pop(images.ctypes.data, None)
        if k is None:
            return images
        slot = self.first + k
        return SlotRef(_slot_name(self.table_name, slot), slot, _segment(self.arrays[k].nbytes), images.shape)


def _segment(size: int) -> int:
    return max(size, 1)  # a segment of no bytes cannot be mapped


_WORKER: WorkerSlots | None = None  # this worker process's slots (None in the loader's process)


def worker_slots(table: str, workers: int, worker: int) -> None:
    """In a worker: attach to the loader's table; this worker's batches go in its slots from now on."""
    global _WORKER
    if _posixshmem is not None:
        _WORKER = WorkerSlots(table, workers, worker)


def serve_run(run: int) -> None:
    """In a worker: the batches from now on are for the loader's run ``run`` (torch's workers serve several)."""
    if _WORKER is not None:
        _WORKER.run = run


def take(shape: tuple[int, ...]) -> np.ndarray:
    """A batch array for a worker to fill: a free slot if this worker has one, else fresh private memory."""
    array = _WORKER.take(shape) if _WORKER is not None else None
    return np.empty(shape, np.uint8) if array is None else array


def hand_over(output: dict[str, Any]) -> dict[str, Any]:
    """``output`` with its images as a :class:`SlotRef` when they lie in a slot (then only the name crosses)."""
    if _WORKER is not None and "image" in output["batch"]:
        output["batch"]["image"] = _WORKER.hand_over(output["batch"]["image"])
    return output


def plain(shared: np.ndarray) -> np.ndarray:
    """A plain array of the same pixels as one of grain's shared-memory arrays: no copy, nothing left to unlink.

    The segment is mapped a second time, by this array alone; grain's array
    unlinks the segment's name when deleted, and the memory is freed when
    this mapping is (the user drops the batch). Copied where it cannot be.
    """
    name = getattr(getattr(shared, "shm", None), "name", None)
    if not name or not shared.flags.c_contiguous or not isinstance(shared.base, mmap.mmap) or _posixshmem is None:
        return np.array(shared)
    try:
        mapped = _open("/" + name.lstrip("/"), shared.nbytes)
    except (OSError, ValueError):
        return np.array(shared)
    return np.frombuffer(mapped, shared.dtype, count=shared.size).reshape(shared.shape)
