"""Images per second at 256 px against this machine's decode limit: datacat next to the usual pipelines.

    python benchmarks/loader_speed.py [--images 2000] [--workers 2] [--batch 64] [--rounds 1]

Builds a corpus of real photos as img2dataset keeps them at source size
(baseline 4:2:0 JPEGs, quality 85-95, shorter side log-uniform in
256-1024 px, aspect ratio log-uniform in 1:2-2:1, so 0.07-2 MP, mean about
0.5: the corpus the issue's figures were measured on), cut from the
licensed photos in tests/data/images at their own pixel density (scaled by
0.75-1.5x; a canvas one photo cannot fill is tiled with several, so a large
image keeps a photo's detail and entropy-decoding cost instead of an
upscaled blur), as webdataset tars and ArrayRecord shards. 2000 of them by
default: at 1000 images/s an epoch of 1000 is one second, shorter than this
VM's speed swings. Then it prints, in one run:

- the **limit**: one core's fastest decode + centre crop + resize to 256 px
  that keeps >= 35 dB PSNR against a float reference (full decode, float
  area resize), times the cores: of the fast decode below, datacat's own
  transform (power-of-two DCT reduction, linear resize) and PIL's.
  This VM's speed drifts by a third within minutes, so limit passes are
  taken all through the run, one beside each loader's streams, and each
  loader is held against the passes on either side of it. Each pass also
  runs the same decode (the corpus four times over) in one forked process a
  core at once, no IPC: how far this machine's cores scale together, and
  each loader against that ("of 2-proc": 1.0 is a loader that adds nothing
  to the decode);
- each loader's **steady rate** (timed inside a 4-epoch stream from the end
  of its first epoch to the end of its third, so neither start-up nor drain
  falls in it), its ratio to the limit, **CPU-ms per image** over the same
  epochs (every busy CPU of the machine, so forkserver and spawned workers
  count), its **1-epoch rate** (the stream's first epoch, start-up included)
  and **first-batch** time (imports excluded):

    usual torch      wds.WebDataset(...) + PIL decode, torchvision-style Resize(256, BICUBIC) of the
                     whole image + CenterCrop + ToTensor (float32) + DataLoader
    usual grain      MapDataset over ArrayRecordDataSource + the same PIL work (uint8) + mp_prefetch
    fast torch/grain the same two with the fast decode + resize (libjpeg-turbo at the tightest M/8
                     scale, linear resize: the referee's P1f/P2f), uint8 batches
    fast torch with datacat's decode: how much of datacat's lead is its decode (no check)
    lean loader      the least a loader with worker processes does (pread from the tars by offset,
                     datacat's decode into a shared-memory ring, nothing else): where the limit leaves
                     any such loader on this machine (no check)
    datacat          torch over the tars, torch over ArrayRecord, jax (grain) over ArrayRecord

- and the issue's checks, each against its figure.

Each stream runs in a process of its own, after a wait (bounded) for a quiet
machine; a stream during whose steady epochs the hypervisor stole > 10 % of
the machine is run again once. Loaders alternate over ``--rounds``; the figures
are medians over rounds.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
SIZE = 256
PHOTOS = [
    "skimage/astronaut.png",
    "skimage/chelsea.png",
    "skimage/coffee.png",
    "skimage/retina.jpg",
    "skimage/rocket.jpg",
    "sklearn/china.jpg",
    "sklearn/flower.jpg",
    "skimage/camera.png",
]
STOLEN_AT_MOST = 10.0  # % of the machine the hypervisor may steal in a stream's steady epochs before it is run again
# The forked-process pass decodes the corpus this many times over: over one corpus (~1.7 s) it read ~5 % low
# (1.79-2.08x one core, mean 1.91, against 1.74-2.14x, mean 2.00, over four, in the same 4 rounds here): the
# children's first images and the wait for the later of the two weigh on so short a pass.
TOGETHER_PASSES = 4
CALIBRATION_ROUNDS = 5  # rounds of paired one-core passes that choose the limit's method


# ---------------------------------------------------------------------- corpus --
def _piece(rng: np.random.Generator, photo: Image.Image, width: int, height: int, scale: float) -> Image.Image:
    """A width x height cut of photo shown at ``scale``, flipped at random."""
    src_w, src_h = min(photo.width, max(1, round(width / scale))), min(photo.height, max(1, round(height / scale)))
    x, y = int(rng.integers(0, photo.width - src_w + 1)), int(rng.integers(0, photo.height - src_h + 1))
    piece = photo.crop((x, y, x + src_w, y + src_h)).resize((width, height), Image.Resampling.BICUBIC)
    return piece.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if rng.random() < 0.5 else piece


def _picture(rng: np.random.Generator, photos: list[Image.Image], width: int, height: int) -> Image.Image:
    """A width x height picture at about a photo's own pixel density: one photo, or a grid of several."""
    scale = math.exp(rng.uniform(math.log(0.75), math.log(1.33)))
    photo = photos[int(rng.integers(len(photos)))]
    cover = max(width / photo.width, height / photo.height)  # the scale at which this photo fills the canvas
    if cover <= max(scale, 1.5):
        return _piece(rng, photo, width, height, max(scale, cover))
    columns, rows = math.ceil(width / (460 * scale)), math.ceil(height / (460 * scale))
    xs = np.linspace(0, width, columns + 1).round().astype(int)
    ys = np.linspace(0, height, rows + 1).round().astype(int)
    canvas = Image.new("RGB", (width, height))
    for top, bottom in itertools.pairwise(ys):
        for left, right in itertools.pairwise(xs):
            tile = photos[int(rng.integers(len(photos)))]
            fill = max(scale, (right - left) / tile.width, (bottom - top) / tile.height)
            canvas.paste(_piece(rng, tile, int(right - left), int(bottom - top), fill), (int(left), int(top)))
    return canvas


def build_corpus(folder: Path, count: int, shards: int) -> dict[str, int]:
    """Writes shards of ``count`` photo JPEGs into folder/{tar,ar}; returns records per shard."""
    from array_record.python import array_record_module
    from shards import write_sample  # benchmarks/, this script's folder

    photos = [Image.open(ROOT / "tests" / "data" / "images" / n).convert("RGB") for n in PHOTOS]
    rng = np.random.default_rng(0)
    (folder / "tar").mkdir(parents=True)
    (folder / "ar").mkdir()
    per_shard, pixels, sizes = {}, [], []
    for shard in range(shards):
        indices = range(shard * count // shards, (shard + 1) * count // shards)
        tar = tarfile.open(folder / "tar" / f"{shard:04d}.tar", "w")  # noqa: SIM115 - closed with the writer below
        writer = array_record_module.ArrayRecordWriter(str(folder / "ar" / f"{shard:04d}.ar"), "group_size:1")
        for i in indices:
            short = round(math.exp(rng.uniform(math.log(256), math.log(1024))))
            aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))  # width / height
            w, h = (round(short * aspect), short) if aspect >= 1 else (short, round(short / aspect))
            buffer = io.BytesIO()
            quality = int(rng.integers(85, 96))
            _picture(rng, photos, w, h).save(buffer, "JPEG", quality=quality, subsampling="4:2:0")
            pixels.append(w * h)
            sizes.append(len(buffer.getvalue()))
            write_sample(tar, writer, f"{shard:04d}{i:05d}", buffer.getvalue(), f"photo {i}")
        tar.close()
        writer.close()
        per_shard[f"{shard:04d}"] = len(indices)
    bits = 8 * np.array(sizes) / np.array(pixels)
    print(
        f"corpus: {count} JPEGs, {min(pixels) / 1e6:.2f}-{max(pixels) / 1e6:.2f} MP (mean {np.mean(pixels) / 1e6:.2f}), "
        f"{np.median(bits):.1f} bits a pixel (median), {sum(sizes) / 1e6:.0f} MB, {shards} shards, as tars and ArrayRecords"
    )
    return per_shard


def write_catalog(folder: Path, per_shard: dict[str, int]) -> Path:
    last = len(per_shard) - 1
    tars = ", ".join(f"{k}.tar: {v}" for k, v in per_shard.items())
    ars = ", ".join(f"{k}.ar: {v}" for k, v in per_shard.items())
    loading = f"{{image_size: {SIZE}, augmentation: none, val_batches: 0}}"
    path = folder / "bench.yaml"
    path.write_text(
        f"bench-tar: {{description: benchmark tars, format: webdataset, location: {{root: tar, shards: '{{0000..{last:04d}}}.tar'}}, "
        f"totals: {{per_shard: {{{tars}}}}}, loading: {loading}}}\n"
        f"bench-ar: {{description: benchmark ArrayRecords, format: array_record, location: {{root: ar, shards: '{{0000..{last:04d}}}.ar'}}, "
        f"record: {{layout: packed, key: key}}, totals: {{per_shard: {{{ars}}}}}, loading: {loading}}}\n"
    )
    return path


# -------------------------------------------------------------- per-image work --
def _square(image: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    side = min(h, w)
    return image[(h - side) // 2 : (h - side) // 2 + side, (w - side) // 2 : (w - side) // 2 + side]


def fast_decode(data: bytes) -> np.ndarray:
    """The fast decode the issue and the referee name: libjpeg-turbo at the tightest M/8 scale >= 256 px, centre crop, linear resize."""
    import cv2
    import simplejpeg

    image = _square(simplejpeg.decode_jpeg(data, "RGB", min_height=SIZE, min_width=SIZE))
    return image if image.shape[0] == SIZE else cv2.resize(image, (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)


def pil_decode(data: bytes) -> np.ndarray:
    """What a usual pipeline does: PIL decode, then torchvision's Resize(256, BICUBIC) + CenterCrop(256) on PIL.

    The whole image is resized so its shorter side is 256, then cropped
    (torchvision's PIL path, which this torch build cannot import beside it).
    """
    image = Image.open(io.BytesIO(data)).convert("RGB")
    scale = SIZE / min(image.size)
    width, height = (
        (SIZE, int(image.height * scale)) if image.width <= image.height else (int(image.width * scale), SIZE)
    )
    image = image.resize((width, height), Image.Resampling.BICUBIC)
    left, top = round((width - SIZE) / 2), round((height - SIZE) / 2)
    return np.asarray(image.crop((left, top, left + SIZE, top + SIZE)))


def to_tensor(image: np.ndarray) -> object:
    """torchvision's ToTensor: float32 [3, H, W] in [0, 1], as a usual torch pipeline hands its images on."""
    import torch

    return torch.from_numpy(image).permute(2, 0, 1).contiguous().to(torch.float32).div(255)


def datacat_decode(data: bytes, into: np.ndarray | None = None) -> np.ndarray:
    """datacat's transform: power-of-two DCT reduction, centre crop, linear resize (into ``into`` when given)."""
    from datacat.transforms.decode import decode_image
    from datacat.transforms.resize import resize_image

    return resize_image(decode_image(data, at_least=SIZE), SIZE, into=into)


METHODS: dict[str, Callable[[bytes], np.ndarray]] = {
    "fast": fast_decode,
    "datacat": datacat_decode,
    "pil": pil_decode,
}


def reference(data: bytes) -> np.ndarray:
    import cv2
    import simplejpeg

    full = _square(simplejpeg.decode_jpeg(data, "RGB").astype(np.float32))
    return cv2.resize(full, (SIZE, SIZE), interpolation=cv2.INTER_AREA)  # type: ignore[no-any-return]


def psnr(image: np.ndarray, truth: np.ndarray) -> float:
    mse = float(np.mean((image.astype(np.float32) - truth) ** 2))
    return 99.0 if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def corpus_jpegs(folder: Path) -> list[bytes]:
    out = []
    for path in sorted((folder / "tar").glob("*.tar")):
        with tarfile.open(path) as tar:
            out += [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")]  # type: ignore[union-attr]
    return out


# ---------------------------------------------------------------- the machine --
def _machine_ticks() -> tuple[int, int, int]:
    """(busy, total, stolen) CPU ticks of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as stat:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in stat.readline().split()[1:9])
    return user + nice + system + irq + softirq, user + nice + system + idle + iowait + irq + softirq + steal, steal


def wait_for_quiet(at_most: float = 20.0) -> None:
    """Returns once the machine was < 10 % busy for half a second (this process idle meanwhile), or after ``at_most`` s."""
    deadline = time.monotonic() + at_most
    while time.monotonic() < deadline:
        busy, total, _ = _machine_ticks()
        time.sleep(0.5)
        busy2, total2, _ = _machine_ticks()
        if busy2 - busy < 0.10 * max(1, total2 - total):
            return


# ----------------------------------------------------------------------- limit --
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
    ratios deciding. Medians of three rates each once picked the fast
    decode over datacat's transform, 550/s against 547/s, where the two
    usually differ by 1.1-1.2x: the limit fell to the slower method.
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


# --------------------------------------------------------------------- loaders --
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

    from datacat.backends.base import keep_freed_memory

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


def _count(batch: object) -> int:
    if isinstance(batch, dict):
        return len(batch["key"])
    if isinstance(batch, list | tuple):
        return len(batch[0])
    return len(batch)  # type: ignore[arg-type]


def _import_for(label: str) -> None:
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


def child(label: str, folder: Path, epochs: int, workers: int, batch: int, epoch_images: int) -> dict[str, object]:
    """One stream: the first batch's time, and (images, seconds, busy, total, stolen ticks) as each epoch ends."""
    _import_for(label)
    (busy, total, stolen), start = _machine_ticks(), time.perf_counter()
    batches = LOADERS[label](folder, epochs, workers, batch)
    images = _count(next(batches))  # type: ignore[call-overload]
    first = time.perf_counter() - start
    marks: list[list[float]] = []
    for item in batches:  # type: ignore[attr-defined]
        images += _count(item)
        if images >= (len(marks) + 1) * epoch_images:  # the batch that ends an epoch
            now, (busy2, total2, stolen2) = time.perf_counter(), _machine_ticks()
            marks.append([images, now - start, busy2 - busy, total2 - total, stolen2 - stolen])
    close = getattr(batches, "close", None)
    if close is not None:
        close()
    return {"first": first, "epochs": marks}


def run_stream(label: str, folder: str, epochs: int, args: argparse.Namespace) -> dict[str, object]:
    """One stream of ``epochs`` epochs of ``label`` in a fresh process, after a quiet wait."""
    command = [sys.executable, __file__, "--child", label, "--folder", folder, "--epochs", str(epochs)]
    command += ["--workers", str(args.workers), "--batch", str(args.batch), "--images", str(args.images)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    wait_for_quiet()
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env, cwd=folder)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{label} failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])  # type: ignore[no-any-return]


STREAM_EPOCHS = 4
"""Epochs a stream runs: the 1-epoch rate is its first epoch, the steady rate its 2nd and 3rd (the 4th keeps
every worker busy to the end of the 3rd, so no drain falls in the window)."""


def measure_loader(label: str, folder: str, args: argparse.Namespace) -> dict[str, float]:
    """``label``'s first batch, 1-epoch rate and steady rate from one stream; again once if much was stolen.

    The steady rate is timed inside the stream, from the end of epoch 1 to
    the end of epoch 3. (The difference of a 1-epoch and a 3-epoch stream,
    which the referee takes, carries two start-ups: a spawned grain worker
    imports jax, 2-4 s with a few tenths' jitter, which moved a 2-epoch
    difference by 10-20 % here.)
    """
    for attempt in range(2):
        stream = run_stream(label, folder, STREAM_EPOCHS, args)
        ends = stream["epochs"]
        (n1, t1, busy1, total1, stolen1), (n3, t3, busy3, total3, stolen3) = ends[0], ends[2]  # type: ignore[index]
        stolen = 100 * (stolen3 - stolen1) / max(1, total3 - total1)
        if stolen <= STOLEN_AT_MOST or attempt == 1:
            break
    images = n3 - n1
    return {
        "steady": images / (t3 - t1),
        "cpu_ms": 1000 * (busy3 - busy1) / os.sysconf("SC_CLK_TCK") / images,
        "first": float(stream["first"]),  # type: ignore[arg-type]
        "one_epoch": n1 / t1,
        "stolen": stolen,
    }


# ------------------------------------------------------------------------ main --
def report(results: dict[str, dict[str, float]], limit: dict[str, float | str]) -> None:
    """The table, then each of the issue's checks against its figure."""
    print(
        f"  {'loader':32s} {'steady img/s':>12s} {'of limit':>9s} {'of 2-proc':>10s} {'CPU-ms/img':>11s} "
        f"{'1 epoch':>8s} {'first':>7s} {'stolen':>7s}"
    )
    for label, m in results.items():
        print(
            f"  {label:32s} {m['steady']:12.0f} {m['of_limit']:9.2f} {m['of_together']:10.2f} {m['cpu_ms']:11.2f} "
            f"{m['one_epoch']:8.0f} {m['first']:6.2f}s {m['stolen']:6.1f}%"
        )
    checks: list[tuple[str, bool]] = []
    quality = float(limit["datacat_psnr"])
    checks.append((f"datacat's transform {quality:.1f} dB PSNR (>= 35)", quality >= 35))
    for label, (usual, fast) in BASELINES.items():
        if label not in results:
            continue
        m = results[label]
        checks.append((f"{label}: {m['of_limit']:.3f} of the limit (>= 0.90)", m["of_limit"] >= 0.90))
        for name, figure, floor in ((fast, "fast", 1.2), (usual, "usual", 4.0)):
            if name in results:
                times = m["steady"] / results[name]["steady"]
                checks.append((f"{label}: {times:.3f}x the {figure} pipeline {name!r} (>= {floor})", times >= floor))
        checks.append((f"{label}: first batch {m['first']:.2f} s (< 0.6)", m["first"] < 0.6))
        checks.append(
            (
                f"{label}: steady {m['steady']:.0f} img/s (epochs 2-3 of 4) >= its 1-epoch {m['one_epoch']:.0f}",
                m["steady"] >= m["one_epoch"],
            )
        )
    jax, torch = results.get("datacat jax, ArrayRecord"), results.get("datacat torch, ArrayRecord")
    if jax and torch:
        cpu = jax["cpu_ms"] / torch["cpu_ms"]
        checks.append((f"jax's CPU an image {cpu:.3f}x torch's over the same shards (within 10 %)", cpu <= 1.10))
        gap = jax["first"] - torch["first"]
        checks.append((f"jax's first batch {gap:+.2f} s from torch's (within 0.3 s)", gap <= 0.3))
    print("\nthe issue's figures:")
    for text, held in checks:
        print(f"  {'yes' if held else 'NO '}  {text}")
    lean = results.get(LEAN)
    if lean:  # no check: what the limit leaves to any loader that hands batches over from worker processes
        print(f"\n{LEAN!r} at {lean['of_limit']:.3f} of the limit; each datacat loader against it:")
        for label in BASELINES:
            if label in results:
                print(f"  {label}: {results[label]['steady'] / lean['steady']:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="", help="labels to run, separated by ';' (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # progress shows as it comes
    if args.child:
        result = child(args.child, Path(args.folder), args.epochs, args.workers, args.batch, args.images)
        print("RESULT " + json.dumps(result))
        return
    labels = [label for label in LOADERS if not args.only or label in args.only.split(";")]
    cores = os.cpu_count() or 1
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="datacat-bench-") as tmp:
        folder = Path(tmp)
        write_catalog(folder, build_corpus(folder, args.images, args.shards))
        jpegs = corpus_jpegs(folder)
        limit = calibrate(jpegs)
        method = str(limit["method"])
        print(
            f"one core, decode + crop + resize to {SIZE} px (median of {CALIBRATION_ROUNDS} passes; PIL's one): "
            + ", ".join(
                f"{n} {limit[f'{n}_per_core']:.0f}/s, {limit[f'{n}_vs_fast']:.2f}x fast pass beside it "
                f"({limit[f'{n}_psnr']:.1f} dB)"
                for n in METHODS
            )
            + f"; the limit's method: {method}"
        )
        rounds: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
        passes = [limit_pass(method, jpegs, cores)]
        for _ in range(args.rounds):
            for label in labels:
                measured = measure_loader(label, tmp, args)
                passes.append(limit_pass(method, jpegs, cores))
                # Held against the limit as it was beside it: the passes just before and just after.
                one_core, together = (statistics.mean(p[k] for p in passes[-2:]) for k in (0, 1))
                measured["of_limit"] = measured["steady"] / (cores * one_core)
                measured["of_together"] = measured["steady"] / together if together else math.nan
                rounds[label].append(measured)
                print(
                    f"  {label}: {measured['steady']:.0f} img/s steady, {measured['of_limit']:.2f} of the limit "
                    f"beside it; first batch {measured['first']:.2f} s",
                    flush=True,
                )
        singles, scaling = [p[0] for p in passes], [p[1] / p[0] for p in passes]
        print(
            f"\nlimit: {method!r} x {cores} cores; one core ran at {min(singles):.0f}-{max(singles):.0f}/s over the "
            f"run ({len(passes)} passes, median {statistics.median(singles):.0f}, so {cores * statistics.median(singles):.0f}"
            f" images/s); each loader is held against the passes just before and after it"
        )
        if cores > 1:
            print(
                f"{cores} forked processes of {method!r} at once, no IPC, in the same passes: "
                f"{min(scaling):.2f}-{max(scaling):.2f}x one core (median {statistics.median(scaling):.2f})\n"
            )
        print(f"{SIZE} px, batch {args.batch}, {args.workers} workers; median of {args.rounds} round(s):")
        medians = {label: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for label, runs in rounds.items()}
        report(medians, limit)
    print(f"\n{time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
