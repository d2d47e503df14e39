"""The benchmarks' corpus: real-photo JPEGs at source size as webdataset tars and ArrayRecord shards, and its catalog.

Pictures are cut from the licensed photos in tests/data/images at their own
pixel density, the way img2dataset keeps them (baseline 4:2:0 JPEGs, quality
85-95, shorter side log-uniform in 256-1024 px, aspect ratio log-uniform in
1:2-2:1); a canvas one photo cannot fill is tiled with several rather than
upscaled, so a large image keeps a photo's detail and decoding cost.
"""

from __future__ import annotations

import io
import itertools
import math
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

from decodes import SIZE

ROOT = Path(__file__).resolve().parent.parent
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


def corpus_jpegs(folder: Path) -> list[bytes]:
    """Every JPEG of the corpus's tars, in shard order."""
    out = []
    for path in sorted((folder / "tar").glob("*.tar")):
        with tarfile.open(path) as tar:
            out += [tar.extractfile(m).read() for m in tar if m.name.endswith(".jpg")]  # type: ignore[union-attr]
    return out
