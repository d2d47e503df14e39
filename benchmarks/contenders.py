"""The contenders of loader_speed.py: the usual pipelines, the same with the fast decode, a lean loader and datacat's.

Each is a function ``(folder, epochs, workers, batch) -> iterator of batches``
over the corpus in folder (corpus.py), named by its label in :data:`LOADERS`.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import queue
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from decodes import SIZE, datacat_decode, fast_decode, pil_decode, to_tensor


def _usual_torch(folder: Path, epochs: int, workers: int, batch: int, decode) -> object:  # type: ignore[no-untyped-def]
    import torch
    import webdataset as wds

    urls = sorted(str(p) for p in (folder / "tar").glob("*.tar"))
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, empty_check=False, nodesplitter=wds.split_by_node)
        .shuffle(1000)
        .to_tuple("jpg", "txt")
        .map(lambda s: (decode(s[0]), s[1].decode()))
        .repeat(epochs)  # one pass per epoch, each worker
    )
    return iter(torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=workers))


def _usual_grain(folder: Path, epochs: int, workers: int, batch: int, decode) -> object:  # type: ignore[no-untyped-def]
    import grain
    from absl import flags
    from array_record.python.array_record_data_source import ArrayRecordDataSource

    from datacat.formats.packed import unpack_record

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # grain issue #1355
    source = ArrayRecordDataSource(sorted(str(p) for p in (folder / "ar").glob("*.ar")))
    dataset = (
        grain.MapDataset.source(source)
        .shuffle(seed=0)
        .repeat(epochs)
        .map(lambda r: decode(unpack_record(r)["jpg"]))
        .batch(batch)
        .to_iter_dataset()
        .mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=workers))
    )
    return iter(dataset)


def _lean_worker(urls: list[str], ring_name: str, shape: tuple[int, ...], tasks: Any, done: Any) -> None:
    from multiprocessing import shared_memory

    from datacat.backends.malloc import keep_freed_memory

    keep_freed_memory()
    memory = shared_memory.SharedMemory(name=ring_name)
    ring = np.ndarray(shape, np.uint8, buffer=memory.buf)
    files = [os.open(url, os.O_RDONLY) for url in urls]
    try:
        while (task := tasks.get()) is not None:
            slot, spans = task
            for row, (shard, offset, size) in enumerate(spans):
                datacat_decode(os.pread(files[shard], size, offset), into=ring[slot, row])
            done.put((slot, len(spans)))
    except Exception as exc:  # said, not left to hang the main process's wait
        done.put((-1, f"{type(exc).__name__}: {exc}"))
    finally:
        for descriptor in files:
            os.close(descriptor)
        del ring
        memory.close()


def _next_done(done: Any, processes: list[Any]) -> tuple[int, Any]:
    # The next finished batch; a worker that died without a word (a signal) is said, not waited on.
    while True:
        try:
            return done.get(timeout=5)  # type: ignore[no-any-return]
        except queue.Empty:
            if not all(process.is_alive() for process in processes):
                raise RuntimeError("a lean loader worker died") from None


def _lean(folder: Path, epochs: int, workers: int, batch: int) -> object:
    """The least a loader with worker processes does, for scale: no datacat loader can beat it by much.

    Forked workers ``pread`` each JPEG from its tar at an offset indexed up
    front, decode + resize it with datacat's transform (the limit's method)
    into a row of a shared-memory ring and name the slot; the main process
    hands out shuffled batches and yields each slot as an array. No
    captions, keys, bad-sample handling, resumption or read-ahead.
    """
    from multiprocessing import shared_memory

    urls = sorted(str(p) for p in (folder / "tar").glob("*.tar"))
    spans = []
    for shard, url in enumerate(urls):
        with tarfile.open(url) as tar:
            spans += [(shard, m.offset_data, m.size) for m in tar if m.name.endswith(".jpg")]
    slots = 3 * workers
    shape = (slots, batch, SIZE, SIZE, 3)
    memory = shared_memory.SharedMemory(create=True, size=math.prod(shape))
    context = multiprocessing.get_context("fork")
    tasks, done = context.SimpleQueue(), context.Queue()
    processes = [
        context.Process(target=_lean_worker, args=(urls, memory.name, shape, tasks, done), daemon=True)
        for _ in range(workers)
    ]
    for process in processes:
        process.start()
    order = itertools.chain.from_iterable(np.random.default_rng(e).permutation(len(spans)) for e in range(epochs))
    batches = (
        [spans[i] for i in chunk] for chunk in iter(lambda: list(itertools.islice(order, batch)), [])
    )  # every epoch's records in a new order, cut into batches
    ring = np.ndarray(shape, np.uint8, buffer=memory.buf)

    def stream() -> object:
        try:
            pending = 0
            for slot in range(slots):
                if (task := next(batches, None)) is not None:
                    tasks.put((slot, task))
                    pending += 1
            while pending:
                slot, count = _next_done(done, processes)
                if slot < 0:
                    raise RuntimeError(f"a lean loader worker failed: {count}")
                pending -= 1
                yield ring[slot, :count]  # the consumer is done with it when it asks for the next
                if (task := next(batches, None)) is not None:
                    tasks.put((slot, task))
                    pending += 1
        finally:
            for _ in processes:
                tasks.put(None)
            for process in processes:
                process.join(timeout=10)
            memory.unlink()  # mapped here until this process ends: the consumer may still hold the last batch

    return stream()


def _datacat(folder: Path, epochs: int, workers: int, batch: int, framework: str, name: str) -> object:
    import datacat

    catalog = datacat.load_catalog([folder / "bench.yaml"])
    return iter(
        datacat.open(name, framework=framework, batch_size=batch, num_workers=workers, catalog=catalog, epochs=epochs)
    )


def _torch_uint8(image: np.ndarray) -> object:
    import torch

    return torch.from_numpy(image)


LEAN = "lean loader (datacat's decode)"
LOADERS = {
    "usual torch (wds + PIL)": lambda f, e, w, b: _usual_torch(f, e, w, b, lambda d: to_tensor(pil_decode(d))),
    "usual grain (PIL)": lambda f, e, w, b: _usual_grain(f, e, w, b, pil_decode),
    "fast torch (wds + fast decode)": lambda f, e, w, b: _usual_torch(
        f, e, w, b, lambda d: _torch_uint8(fast_decode(d))
    ),
    "fast torch (datacat's decode)": lambda f, e, w, b: _usual_torch(
        f, e, w, b, lambda d: _torch_uint8(datacat_decode(d))
    ),
    "fast grain (fast decode)": lambda f, e, w, b: _usual_grain(f, e, w, b, fast_decode),
    LEAN: _lean,
    "datacat torch, tars": lambda f, e, w, b: _datacat(f, e, w, b, "torch", "bench-tar"),
    "datacat torch, ArrayRecord": lambda f, e, w, b: _datacat(f, e, w, b, "torch", "bench-ar"),
    "datacat jax, ArrayRecord": lambda f, e, w, b: _datacat(f, e, w, b, "jax", "bench-ar"),
}
# Which pipelines each datacat loader is held against: (usual, same pipeline with the fast decode).
BASELINES = {
    "datacat torch, tars": ("usual torch (wds + PIL)", "fast torch (wds + fast decode)"),
    "datacat torch, ArrayRecord": ("usual torch (wds + PIL)", "fast torch (wds + fast decode)"),
    "datacat jax, ArrayRecord": ("usual grain (PIL)", "fast grain (fast decode)"),
}


def count_images(batch: object) -> int:
    if isinstance(batch, dict):
        return len(batch["key"])
    if isinstance(batch, list | tuple):
        return len(batch[0])
    return len(batch)  # type: ignore[arg-type]


def import_for(label: str) -> None:
    # Imports are paid once per process whatever the loader; the clock starts after them.
    if "grain" in label or "jax" in label:
        import grain  # noqa: F401
    if "torch" in label:
        import torch  # noqa: F401
        import webdataset  # noqa: F401
    if label.startswith("lean"):
        import datacat.backends.base
        import datacat.transforms.decode
        import datacat.transforms.resize  # noqa: F401
    if label.startswith("datacat"):
        import importlib

        importlib.import_module("datacat.backends.jax" if "jax" in label else "datacat.backends.torch")
