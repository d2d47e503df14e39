"""The limit: one core's fastest decode at >= 35 dB times the cores, measured in passes beside the loaders.

Also the machine's own state from /proc/stat, to wait for a quiet machine
and to count every busy CPU.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable

import numpy as np

from decodes import METHODS, psnr, reference

# The forked-process pass decodes the corpus this many times over: over one corpus (~1.7 s) it reads ~5 % low,
# the children's first images and the wait for the later of the two weighing on so short a pass.
TOGETHER_PASSES = 4
CALIBRATION_ROUNDS = 5  # rounds of paired one-core passes that choose the limit's method


def machine_ticks() -> tuple[int, int, int]:
    """(busy, total, stolen) CPU ticks of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in stat.readline().split()[1:9])
    return user + nice + system + irq + softirq, user + nice + system + idle + iowait + irq + softirq + steal, steal


def wait_for_quiet(at_most: float = 20.0) -> None:
    """Returns once the machine was < 10 % busy for half a second (this process idle meanwhile), or after ``at_most`` s."""
    deadline = time.monotonic() + at_most
    while time.monotonic() < deadline:
        busy, total, _ = machine_ticks()
        time.sleep(0.5)
        busy2, total2, _ = machine_ticks()
        if busy2 - busy < 0.10 * max(1, total2 - total):
            return


def one_core_pass(method: Callable[[bytes], np.ndarray], jpegs: list[bytes]) -> float:
    """Images per second of ``method`` over every JPEG in this one process, after a quiet wait."""
    wait_for_quiet()
    start = time.perf_counter()
    for data in jpegs:
        method(data)
    return len(jpegs) / (time.perf_counter() - start)


def _decode_part(method: str, jpegs: list[bytes], ready: object, done: object) -> None:
    ready.wait()  # type: ignore[attr-defined]
    for data in jpegs:
        METHODS[method](data)
    done.put(time.perf_counter())  # type: ignore[attr-defined]


def parallel_pass(method: str, jpegs: list[bytes], processes: int) -> float:
    """Images per second of ``method`` in ``processes`` forked processes at once, a share of the JPEGs each, no IPC."""
    context = multiprocessing.get_context("fork")
    ready, done = context.Barrier(processes + 1), context.Queue()
    children = [
        context.Process(target=_decode_part, args=(method, jpegs[i::processes], ready, done)) for i in range(processes)
    ]
    wait_for_quiet()
    for process in children:
        process.start()
    ready.wait()
    start = time.perf_counter()
    end = max(done.get() for _ in children)
    for process in children:
        process.join()
    return len(jpegs) / (end - start)


def calibrate(jpegs: list[bytes]) -> dict[str, float | str]:
    """Each method's one-core rate and PSNR, and which is the limit's: the fastest at >= 35 dB.

    The VM's speed moves by a quarter between passes, so the methods are
    compared pass against pass: five rounds of back-to-back passes of every
    method but PIL's (one pass: it runs at a quarter of the others' speed),
    each rate over the same round's fast-decode pass, the median of those
    ratios deciding: medians of a few rates alone can pick the slower of
    two methods whose difference is smaller than the drift between passes.
    """
    import cv2

    cv2.setNumThreads(1)
    truths = [reference(d) for d in jpegs[:200]]
    out: dict[str, float | str] = {}
    passes: dict[str, list[float]] = {name: [] for name in METHODS}
    for round_ in range(CALIBRATION_ROUNDS):
        for name, method in METHODS.items():
            if name != "pil" or round_ == 0:
                passes[name].append(one_core_pass(method, jpegs))
    for name, method in METHODS.items():
        out[f"{name}_per_core"] = statistics.median(passes[name])
        out[f"{name}_vs_fast"] = statistics.median(r / f for r, f in zip(passes[name], passes["fast"], strict=False))
        out[f"{name}_psnr"] = statistics.mean(psnr(method(d), t) for d, t in zip(jpegs, truths, strict=False))
    usable = [name for name in METHODS if float(out[f"{name}_psnr"]) >= 35]
    out["method"] = max(usable, key=lambda name: float(out[f"{name}_vs_fast"]))
    return out


def limit_pass(method: str, jpegs: list[bytes], cores: int) -> tuple[float, float]:
    """Images per second of the limit's method on one core, and in ``cores`` processes at once."""
    one = one_core_pass(METHODS[method], jpegs)
    return one, parallel_pass(method, jpegs * TOGETHER_PASSES, cores) if cores > 1 else 0.0
