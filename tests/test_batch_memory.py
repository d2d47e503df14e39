"""Reusable shared-memory batch slots between grain workers and the loader, in one process (no grain, no jax)."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import numpy as np
import pytest

from datacat.backends import batch_memory
from datacat.backends.batch_memory import SLOTS, SlotRef, Slots, WorkerSlots, _posixshmem

SHAPE = (4, 8, 8, 3)


@pytest.fixture
def slots() -> Iterator[tuple[Slots, WorkerSlots]]:
    loader = Slots(workers=2)
    worker = WorkerSlots(*loader.worker_args, worker=1)
    yield loader, worker
    loader.close()


def shm_names(slots: Slots) -> set[str]:
    """Which of the table's and its workers' slot names are still there (POSIX: no /dev/shm listing needed)."""
    names = [slots.name] + [batch_memory._slot_name(slots.name, slot) for slot in range(SLOTS * slots.workers)]
    there = set()
    for name in names:
        try:
            os.close(_posixshmem.shm_open(name, os.O_RDONLY, mode=0o600))
        except FileNotFoundError:
            continue
        there.add(name)
    return there


def batch(worker: WorkerSlots, value: int, rows: int = 4) -> SlotRef:
    array = worker.take((rows, *SHAPE[1:]))
    assert array is not None
    array[:] = value
    ref = worker.hand_over(array)
    assert isinstance(ref, SlotRef)
    return ref


def test_a_slot_is_filled_again_only_once_every_view_of_it_is_gone(slots: tuple[Slots, WorkerSlots]) -> None:
    loader, worker = slots
    images = loader.receive(batch(worker, 7))
    assert images.shape == SHAPE and (images == 7).all() and type(images) is np.ndarray
    view, pixels = images[2:], memoryview(images[1])
    first = images.ctypes.data
    del images
    loader.release()
    assert loader.table[SLOTS + 0] == 1  # worker 1's first slot: still held through the views
    second = loader.receive(batch(worker, 9))
    assert second.ctypes.data != first and (view == 7).all() and pixels[0, 0, 0] == 7
    del view, pixels
    gc.collect()
    loader.release()  # as the loader does at each batch it receives
    third = loader.receive(batch(worker, 5))
    assert third.ctypes.data == first  # the first slot again, in the loader's one mapping of it
    assert (third == 5).all() and (second == 9).all()


def test_a_short_batch_is_the_head_of_its_slot(slots: tuple[Slots, WorkerSlots]) -> None:
    loader, worker = slots
    loader.receive(batch(worker, 1))  # dropped at once: the slot is free again
    loader.release()
    ref = batch(worker, 3, rows=2)  # fewer rows (bad samples left out) fit in the same slot
    assert ref.slot == SLOTS and ref.shape == (2, *SHAPE[1:])
    assert (loader.receive(ref) == 3).all()
    assert worker.hand_over(np.zeros(SHAPE, np.uint8)).shape == SHAPE  # an array of no slot goes as it is


def test_a_worker_whose_slots_are_all_held_gives_fresh_memory(slots: tuple[Slots, WorkerSlots]) -> None:
    loader, worker = slots
    held = [loader.receive(batch(worker, k)) for k in range(SLOTS)]
    assert worker.take(SHAPE) is None
    batch_memory._WORKER = worker
    try:
        fresh = batch_memory.take(SHAPE)
        assert fresh.shape == SHAPE and not any(np.shares_memory(fresh, h) for h in held)
        assert batch_memory.hand_over({"batch": {"image": fresh}})["batch"]["image"] is fresh
    finally:
        batch_memory._WORKER = None
    assert [int(h[0, 0, 0, 0]) for h in held] == list(range(SLOTS))


def test_closing_unlinks_every_name_even_of_slots_never_received(slots: tuple[Slots, WorkerSlots]) -> None:
    loader, worker = slots
    received = loader.receive(batch(worker, 4))
    batch(worker, 6)  # made and handed over, never received (a run closed with batches on their way)
    assert len(shm_names(loader)) == 2  # the table and the unreceived slot; the received one is unlinked
    loader.close()
    assert shm_names(loader) == set()
    assert (received == 4).all()  # the loop's array outlives the run


def test_a_run_started_again_gets_back_the_slots_of_batches_that_never_arrived(
    slots: tuple[Slots, WorkerSlots],
) -> None:
    loader, worker = slots
    worker.run = 1
    kept = loader.receive(batch(worker, 1))
    lost = batch(worker, 2)  # filled for run 1, dropped on its way when run 2 started
    worker.run = 2
    loader.reclaim(2)
    assert loader.table[lost.slot] == 0  # free: its batch will never reach the loader
    assert loader.table[SLOTS + 0] == 1 and (kept == 1).all()  # still held by the loop
    again = batch(worker, 3)
    assert again.slot == lost.slot and loader.table[again.slot] == 2
    del kept
    loader.reclaim(3)
    assert (loader.table == 0).all()
