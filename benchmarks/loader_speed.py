"""Images per second at 256 px against this machine's decode limit: datacat next to the usual pipelines.

    python benchmarks/loader_speed.py [--images 1000] [--workers 2] [--batch 64] [--rounds 1]

Builds a corpus of real photos as img2dataset writes them (JPEGs of 0.2-1
megapixel: random crops and scales of the licensed photos in
tests/data/images) as webdataset tars and ArrayRecord shards, then prints, in
one run:

- the **limit**: one core's fastest decode + centre crop + resize to 256 px
  that keeps >= 35 dB PSNR against a float reference (full decode, float
  area resize), times the cores; and the PSNR of datacat's own transform;
- each loader's **steady rate** (the difference of a 1-epoch and a 3-epoch
  stream, so start-up and drain cancel), its ratio to the limit, **CPU-ms
  per image** (every process on the machine, so forkserver and spawned
  workers count: run it on a quiet machine) and **first-batch** time:

    usual torch      wds.WebDataset(...).decode("pil") + PIL crop/resize (BICUBIC) + DataLoader
    usual grain      MapDataset over ArrayRecordDataSource + PIL + mp_prefetch
    fast torch/grain the same two with the limit's decode + resize
    datacat          torch over the tars, torch over ArrayRecord, jax (grain) over ArrayRecord

Each loader runs in its own process, alternating over ``--rounds``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

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


def build_corpus(folder: Path, count: int, shards: int) -> dict[str, int]:
    """Writes shards of ``count`` JPEGs of 0.2-1 MP into folder/{tar,ar}; returns records per shard."""
    from array_record.python import array_record_module
    from shards import write_sample  # benchmarks/, this script's folder

    photos = [Image.open(ROOT / "tests" / "data" / "images" / n).convert("RGB") for n in PHOTOS]
    rng = np.random.default_rng(0)
    (folder / "tar").mkdir(parents=True)
    (folder / "ar").mkdir()
    per_shard, pixels = {}, []
    for shard in range(shards):
        indices = range(shard * count // shards, (shard + 1) * count // shards)
        tar = tarfile.open(folder / "tar" / f"{shard:04d}.tar", "w")  # noqa: SIM115 - closed with the writer below
        writer = array_record_module.ArrayRecordWriter(str(folder / "ar" / f"{shard:04d}.ar"), "group_size:1")
        for i in indices:
            photo = photos[i % len(photos)]
            megapixels, aspect = rng.uniform(0.2, 1.0), rng.uniform(0.67, 1.5)
            w, h = int((megapixels * 1e6 * aspect) ** 0.5), int((megapixels * 1e6 / aspect) ** 0.5)
            cw, ch = int(photo.width * rng.uniform(0.6, 1.0)), int(photo.height * rng.uniform(0.6, 1.0))
            x, y = int(rng.integers(0, photo.width - cw + 1)), int(rng.integers(0, photo.height - ch + 1))
            image = photo.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.BICUBIC)
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=90)
            pixels.append(w * h)
            write_sample(tar, writer, f"{shard:04d}{i:05d}", buffer.getvalue(), f"photo {i}")
        tar.close()
        writer.close()
        per_shard[f"{shard:04d}"] = len(indices)
    print(
        f"corpus: {count} JPEGs, {min(pixels) / 1e6:.2f}-{max(pixels) / 1e6:.2f} MP (mean {np.mean(pixels) / 1e6:.2f}), "
        f"{shards} shards, as tars and ArrayRecords"
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


# ---------------------------------------------------------------- per-image work --
def _square(image: np.ndarray) -> np.ndarray:
    h, w = image.shape[:2]
    side = min(h, w)
    return image[(h - side) // 2 : (h - side) // 2 + side, (w - side) // 2 : (w - side) // 2 + side]


def fast_decode(data: bytes) -> np.ndarray:
    """The limit's method: libjpeg-turbo at the tightest M/8 scale >= 256 px, centre crop, linear resize."""
    import cv2
    import simplejpeg

    image = _square(simplejpeg.decode_jpeg(data, "RGB", min_height=SIZE, min_width=SIZE))
    return image if image.shape[0] == SIZE else cv2.resize(image, (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)


def pil_decode(data: bytes) -> np.ndarray:
    """What a usual pipeline does: PIL decode, centre crop, BICUBIC resize."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    return np.asarray(image.crop((left, top, left + side, top + side)).resize((SIZE, SIZE), Image.Resampling.BICUBIC))


def datacat_decode(data: bytes) -> np.ndarray:
    from datacat.transforms.decode import decode_image
    from datacat.transforms.resize import resize_image

    return resize_image(decode_image(data, at_least=SIZE), SIZE)


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


def measure_limit(folder: Path, cores: int) -> dict[str, float]:
    """One core's images/s of each method (best of 3 passes), its PSNR; the limit is the fastest >= 35 dB x cores."""
    import cv2

    cv2.setNumThreads(1)
    jpegs = corpus_jpegs(folder)
    truths = [reference(d) for d in jpegs[:200]]
    out: dict[str, float] = {}
    for name, method in (("fast", fast_decode), ("datacat", datacat_decode), ("pil", pil_decode)):
        best = 0.0
        for _ in range(3):
            start = time.perf_counter()
            for data in jpegs:
                method(data)
            best = max(best, len(jpegs) / (time.perf_counter() - start))
        quality = statistics.mean(psnr(method(d), t) for d, t in zip(jpegs, truths, strict=False))
        out[f"{name}_per_core"], out[f"{name}_psnr"] = best, quality
    usable = [out[f"{n}_per_core"] for n in ("fast", "datacat", "pil") if out[f"{n}_psnr"] >= 35]
    out["limit"] = max(usable) * cores
    return out


# --------------------------------------------------------------------- loaders --
def _usual_torch(folder: Path, epochs: int, workers: int, batch: int, decode) -> object:  # type: ignore[no-untyped-def]
    import torch
    import webdataset as wds

    urls = sorted(str(p) for p in (folder / "tar").glob("*.tar"))
    dataset = (
        wds.WebDataset(urls, shardshuffle=100, empty_check=False, nodesplitter=wds.split_by_node)
        .shuffle(1000)
        .to_tuple("jpg", "txt")
        .map(lambda s: (torch.from_numpy(decode(s[0])), s[1].decode()))
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


def _datacat(folder: Path, epochs: int, workers: int, batch: int, framework: str, name: str) -> object:
    import datacat

    catalog = datacat.load_catalog([folder / "bench.yaml"])
    return iter(
        datacat.open(name, framework=framework, batch_size=batch, num_workers=workers, catalog=catalog, epochs=epochs)
    )


LOADERS = {
    "usual torch (wds + PIL)": lambda f, e, w, b: _usual_torch(f, e, w, b, pil_decode),
    "usual grain (PIL)": lambda f, e, w, b: _usual_grain(f, e, w, b, pil_decode),
    "fast torch (wds + fast decode)": lambda f, e, w, b: _usual_torch(f, e, w, b, fast_decode),
    "fast grain (fast decode)": lambda f, e, w, b: _usual_grain(f, e, w, b, fast_decode),
    "datacat torch, tars": lambda f, e, w, b: _datacat(f, e, w, b, "torch", "bench-tar"),
    "datacat torch, ArrayRecord": lambda f, e, w, b: _datacat(f, e, w, b, "torch", "bench-ar"),
    "datacat jax, ArrayRecord": lambda f, e, w, b: _datacat(f, e, w, b, "jax", "bench-ar"),
}


def _busy_ticks() -> int:
    """CPU ticks the whole machine spent busy: every process a loader starts counts, wherever it hangs."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


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
    if label.startswith("datacat"):
        import importlib

        importlib.import_module("datacat.backends.jax" if "jax" in label else "datacat.backends.torch")


def child(label: str, folder: Path, epochs: int, workers: int, batch: int) -> dict[str, float]:
    _import_for(label)
    ticks, start = _busy_ticks(), time.perf_counter()
    batches = LOADERS[label](folder, epochs, workers, batch)
    images = _count(next(batches))  # type: ignore[call-overload]
    first = time.perf_counter() - start
    for item in batches:  # type: ignore[attr-defined]
        images += _count(item)
    seconds = time.perf_counter() - start
    busy = (_busy_ticks() - ticks) / os.sysconf("SC_CLK_TCK")
    close = getattr(batches, "close", None)
    if close is not None:
        close()
    return {"images": images, "seconds": seconds, "first": first, "cpu": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="", help="labels to run, separated by ';' (default: all)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, Path(args.folder), args.epochs, args.workers, args.batch)))
        return
    labels = [label for label in LOADERS if not args.only or label in args.only.split(";")]
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="datacat-bench-") as tmp:
        folder = Path(tmp)
        write_catalog(folder, build_corpus(folder, args.images, args.shards))
        limit = measure_limit(folder, cores)
        print(
            f"one core, decode + crop + resize to {SIZE} px: fast {limit['fast_per_core']:.0f}/s "
            f"({limit['fast_psnr']:.1f} dB), datacat's transform {limit['datacat_per_core']:.0f}/s "
            f"({limit['datacat_psnr']:.1f} dB), PIL {limit['pil_per_core']:.0f}/s ({limit['pil_psnr']:.1f} dB)"
        )
        print(f"limit: the fastest >= 35 dB x {cores} cores = {limit['limit']:.0f} images/s\n")
        results: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
        for _ in range(args.rounds):
            for label in labels:
                runs = []
                for epochs in (1, 3):
                    command = [sys.executable, __file__, "--child", label, "--folder", tmp, "--epochs", str(epochs)]
                    command += ["--workers", str(args.workers), "--batch", str(args.batch)]
                    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
                    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env, cwd=tmp)
                    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
                    if line is None:
                        sys.exit(f"{label} failed:\n{done.stderr[-3000:]}")
                    runs.append(json.loads(line[len("RESULT ") :]))
                one, three = runs
                images = three["images"] - one["images"]
                results[label].append(
                    {
                        "steady": images / (three["seconds"] - one["seconds"]),
                        "cpu_ms": 1000 * (three["cpu"] - one["cpu"]) / images,
                        "first": one["first"],
                        "one_epoch": one["images"] / one["seconds"],
                    }
                )
        print(f"{SIZE} px, batch {args.batch}, {args.workers} workers; median of {args.rounds} round(s):")
        print(
            f"  {'loader':32s} {'steady img/s':>12s} {'of limit':>9s} {'CPU-ms/img':>11s} {'1 epoch':>8s} {'first':>7s}"
        )
        for label in labels:
            m = {k: statistics.median(r[k] for r in results[label]) for k in results[label][0]}
            print(
                f"  {label:32s} {m['steady']:12.0f} {m['steady'] / limit['limit']:9.2f} {m['cpu_ms']:11.2f} "
                f"{m['one_epoch']:8.0f} {m['first']:6.2f}s"
            )


if __name__ == "__main__":
    main()
