"""Batch arrays of the loader's own process, filled again once nothing holds them: no fresh pages for every batch.

A batch of 64 images at 256 px is 12.5 MB; allocated afresh, glibc maps
it anew and the kernel zeroes and faults in its 3,000 pages as the batch is
written, which costs about as much as writing the pixels. Worker processes
reuse shared-memory slots (:mod:`datacat.backends.batch_memory`); a batch
built in the loader's process (no workers, or its read-ahead threads) takes
one of these arrays instead. An array is free when only this pool refers to
it: a numpy view keeps its base alive, a tensor from ``torch.from_numpy``
and a jax array over host memory keep the numpy array, so a batch the
training loop still holds is never written over.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

__all__ = ["ARRAYS", "take"]

ARRAYS = 8
"""Arrays kept per shape: those read ahead, those on their way, those the loop holds; past them, fresh memory."""

_POOLS: dict[int, dict[tuple[tuple[int, ...], str], list[np.ndarray]]] = {}
_LOCK = threading.Lock()


def take(shape: tuple[int, ...], dtype: str = "uint8") -> np.ndarray:
    """An array of ``shape`` to fill: one this process made before and nothing holds now, else a new one."""
    with _LOCK:
        pool = _POOLS.setdefault(os.getpid(), {}).setdefault((shape, dtype), [])
        for array in pool:
            # The pool's list, this loop's name and getrefcount's argument: nothing else holds it.
            if sys.getrefcount(array) <= 3:
                return array
        array = np.empty(shape, dtype)
        if len(pool) < ARRAYS:
            pool.append(array)
        return array
