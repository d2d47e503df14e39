"""Images per second at 256 px: datacat's torch and jax loaders next to the usual webdataset pipeline.

    python benchmarks/loader_speed.py [--images 400] [--workers 2] [--rounds 3]

Builds a corpus of real photos as img2dataset writes them (JPEGs of 0.2-1
megapixel, random crops and scales of the licensed photos in
tests/data/images), as webdataset tars and ArrayRecord shards, then times each loader
in its own process, alternating them for ``--rounds`` rounds so that
machine noise hits all alike. Prints the median images/s of each and its
ratio to the usual pipeline:

    usual   wds.WebDataset(...).decode("pil") + PIL center crop and resize + torch DataLoader
    datacat torch over the same tars, torch over ArrayRecord, jax (grain) over ArrayRecord

The clock runs from the first batch (worker start-up is not timed) to the last.
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


def source_photos() -> tuple[list[Image.Image], str]:
    shared = ROOT / "tests" / "data" / "images"
    names = [
        "skimage/astronaut.png",
        "skimage/chelsea.png",
        "skimage/coffee.png",
        "skimage/retina.jpg",
        "skimage/rocket.jpg",
        "sklearn/china.jpg",
        "sklearn/flower.jpg",
        "skimage/camera.png",
    ]
    if shared.is_dir():
        return [Image.open(shared / n).convert("RGB") for n in names], str(shared)
    import datacat

    sample = [
        s for s in datacat.pipeline.SampleSource(datacat.resolve("sample", augmentation="none")).reader.iter_shard(0)
    ]
    return [Image.open(io.BytesIO(s.payload["jpg"])).convert("RGB") for s in sample], "the embedded sample (upscaled)"


def build_corpus(folder: Path, count: int, shards: int) -> dict[str, int]:
    """Writes shards of ``count`` JPEGs of 0.2-1 MP into folder/{tar,ar}; returns records per shard."""
    from array_record.python import array_record_module

    from datacat.formats.packed import pack_record

    photos, origin = source_photos()
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
            megapixels = rng.uniform(0.2, 1.0)
            aspect = rng.uniform(0.67, 1.5)
            w, h = int((megapixels * 1e6 * aspect) ** 0.5), int((megapixels * 1e6 / aspect) ** 0.5)
            cw, ch = int(photo.width * rng.uniform(0.6, 1.0)), int(photo.height * rng.uniform(0.6, 1.0))
            x, y = int(rng.integers(0, photo.width - cw + 1)), int(rng.integers(0, photo.height - ch + 1))
            image = photo.crop((x, y, x + cw, y + ch)).resize((w, h), Image.Resampling.BICUBIC)
            buffer = io.BytesIO()
            image.save(buffer, "JPEG", quality=90)
            data, caption, key = buffer.getvalue(), f"photo {i} from {origin}", f"{shard:04d}{i:05d}"
            pixels.append(w * h)
            for ext, payload in (("jpg", data), ("txt", caption.encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            writer.write(pack_record({"key": key, "jpg": data, "txt": caption}))
        tar.close()
        writer.close()
        per_shard[f"{shard:04d}"] = len(indices)
    print(
        f"corpus: {count} JPEGs, {min(pixels) / 1e6:.2f}-{max(pixels) / 1e6:.2f} MP (mean {np.mean(pixels) / 1e6:.2f}), "
        f"from {origin}, in {shards} shards"
    )
    return per_shard


def write_catalog(folder: Path, per_shard: dict[str, int]) -> Path:
    last = len(per_shard) - 1
    tars = ", ".join(f"{k}.tar: {v}" for k, v in per_shard.items())
    ars = ", ".join(f"{k}.ar: {v}" for k, v in per_shard.items())
    loading = f"{{image_size: {SIZE}, augmentation: flip_only, val_batches: 0}}"
    path = folder / "bench.yaml"
    path.write_text(
        f"bench-tar: {{description: benchmark tars, format: webdataset, location: {{root: tar, shards: '{{0000..{last:04d}}}.tar'}}, "
        f"totals: {{per_shard: {{{tars}}}}}, loading: {loading}}}\n"
        f"bench-ar: {{description: benchmark ArrayRecords, format: array_record, location: {{root: ar, shards: '{{0000..{last:04d}}}.ar'}}, "
        f"record: {{layout: packed, key: key}}, totals: {{per_shard: {{{ars}}}}}, loading: {loading}}}\n"
    )
    return path


def run_usual(folder: Path, workers: int, batch: int) -> tuple[int, float]:
    import torch
    import webdataset as wds

    def crop_resize(sample: tuple[Image.Image, str]) -> tuple[np.ndarray, str]:
        image, caption = sample
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        image = image.crop((left, top, left + side, top + side)).resize((SIZE, SIZE), Image.Resampling.BICUBIC)
        return np.asarray(image), caption

    urls = sorted(str(p) for p in (folder / "tar").glob("*.tar"))
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .decode("pil")
        .to_tuple("jpg", "txt")
        .map(crop_resize)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, num_workers=workers)
    return _time(iter(loader), lambda b: len(b[1]))


def run_datacat(folder: Path, framework: str, name: str, workers: int, batch: int) -> tuple[int, float]:
    import datacat

    catalog = datacat.load_catalog([folder / "bench.yaml"])
    loader = datacat.open(name, framework=framework, batch_size=batch, num_workers=workers, catalog=catalog)
    return _time(iter(loader), lambda b: len(b["key"]))


def _time(batches, count) -> tuple[int, float]:  # type: ignore[no-untyped-def]
    next(batches)  # worker start-up and the first batch are not timed
    images, start = 0, time.perf_counter()
    last = start
    for batch in batches:
        images += count(batch)
        last = time.perf_counter()  # until the last batch arrives; shutting workers down is not loading
    return images, last - start


RUNS = {
    "usual webdataset+PIL, torch": ("usual", None, None),
    "datacat torch, tars": ("datacat", "torch", "bench-tar"),
    "datacat torch, ArrayRecord": ("datacat", "torch", "bench-ar"),
    "datacat jax/grain, ArrayRecord": ("datacat", "jax", "bench-ar"),
}


def child(args: argparse.Namespace) -> None:
    kind, framework, name = RUNS[args.child]
    folder = Path(args.folder)
    if kind == "usual":
        images, seconds = run_usual(folder, args.workers, args.batch)
    else:
        images, seconds = run_datacat(folder, framework, name, args.workers, args.batch)
    print("RESULT " + json.dumps({"images": images, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory(prefix="datacat-bench-") as tmp:
        folder = Path(tmp)
        write_catalog(folder, build_corpus(folder, args.images, args.shards))
        rates: dict[str, list[float]] = {label: [] for label in RUNS}
        for round_number in range(args.rounds):
            for label in RUNS:
                command = [
                    sys.executable,
                    __file__,
                    "--child",
                    label,
                    "--folder",
                    str(folder),
                    "--workers",
                    str(args.workers),
                    "--batch",
                    str(args.batch),
                ]
                done = subprocess.run(
                    command, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONWARNINGS": "ignore"}
                )
                line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
                if line is None:
                    sys.exit(f"{label} failed:\n{done.stderr[-2000:]}")
                result = json.loads(line[len("RESULT ") :])
                rates[label].append(result["images"] / result["seconds"])
            print(f"round {round_number + 1}: " + ", ".join(f"{label} {rates[label][-1]:.0f}/s" for label in RUNS))
        usual = statistics.median(rates["usual webdataset+PIL, torch"])
        print(f"\n{SIZE} px, batch {args.batch}, {args.workers} worker(s) each, median of {args.rounds} rounds:")
        for label in RUNS:
            median = statistics.median(rates[label])
            print(f"  {label:34s} {median:7.1f} images/s   x{median / usual:.2f} the usual pipeline")


if __name__ == "__main__":
    main()
