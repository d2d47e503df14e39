"""Builds the embedded `sample` dataset under catalog/sample/ from the licensed photos in tests/data/images.

    python scripts/build_sample.py [--shared tests]

Writes, deterministically (same bytes on every run):
  webdataset/{0000,0001,0003}.tar          key.jpg, key.txt, key.json per sample (shard 0002 is missing on purpose)
  array_record/{00000,00001,00003}.array_record   the same samples as packed records (jpg, txt, key, meta)
  embeddings/img_emb_{0000,0001,0003}.npy  a 64-dim feature per sample, row = the key's last four digits
and prints the per-shard counts that catalog/sample.yaml declares.

The embeddings are a normalised 4x4x4 RGB colour histogram, not CLIP: real
CLIP weights cannot be fetched here. They exercise the DALLE2-pytorch layout
(shard-aligned .npy files) with values a test can recompute.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from datacat.formats.packed import pack_record  # noqa: E402

# (file under shared/data/images, caption, licence)
PHOTOS = [
    (
        "skimage/astronaut.png",
        "a NASA portrait of astronaut Eileen Collins with the American flag behind her",
        "public domain (NASA)",
    ),
    ("skimage/camera.png", "a black and white photo of a man behind a camera on a tripod", "CC0 (Lav Varshney)"),
    ("skimage/chelsea.png", "a ginger tabby cat looking to the side", "CC0 (Stefan van der Walt)"),
    (
        "skimage/coffee.png",
        "a cup of espresso on a red saucer with a spoon, on a wooden table",
        "CC0 (Rachel Michetti)",
    ),
    (
        "skimage/horse.png",
        "the black silhouette of a horse on a white background",
        "CC0 (Andreas Preuss / openclipart)",
    ),
    ("skimage/retina.jpg", "a fundus photograph of a human retina and its blood vessels", "CC0 1.0 (Mikael Haggstrom)"),
    ("skimage/rocket.jpg", "a rocket on its launch pad at dusk between lightning towers", "public domain (SpaceX)"),
    (
        "sklearn/china.jpg",
        "a red and gold Chinese pagoda on a hill above a lake",
        "CC-BY 2.0, 'Some rights reserved by danielbuechele'",
    ),
    ("sklearn/flower.jpg", "an orange dahlia in front of dark green leaves", "CC-BY 2.0, photo by vultilion"),
    ("pillow/hopper.jpg", "a portrait of Grace Hopper in naval uniform", "public domain; file from Pillow (HPND)"),
    ("pillow/pil_sample_rgb.jpg", "the word RED in red letters on a black background", "HPND (Pillow test image)"),
]
VIEWS = [
    ("whole", ""),
    ("left", ", the left part"),
    ("right", ", the right part"),
    ("top", ", the top part"),
    ("centre", ", a close-up of the centre"),
]
SHARDS = (0, 1, 3)  # shard 2 is declared missing in catalog/sample.yaml
MAX_SIDE = 192
MTIME = 1_700_000_000


def view(image: Image.Image, name: str) -> Image.Image:
    w, h = image.size
    box = {
        "whole": (0, 0, w, h),
        "left": (0, 0, w * 3 // 5, h),
        "right": (w * 2 // 5, 0, w, h),
        "top": (0, 0, w, h * 3 // 5),
        "centre": (w // 4, h // 4, w * 3 // 4, h * 3 // 4),
    }[name]
    out = image.crop(box)
    scale = MAX_SIDE / max(out.size)
    if scale < 1:
        out = out.resize(
            (max(1, round(out.width * scale)), max(1, round(out.height * scale))), Image.Resampling.LANCZOS
        )
    return out


def rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("RGBA", "LA", "P"):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def histogram(jpeg: bytes) -> np.ndarray:
    pixels = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")) // 64
    bins = pixels[..., 0].astype(int) * 16 + pixels[..., 1] * 4 + pixels[..., 2]
    counts = np.bincount(bins.ravel(), minlength=64).astype(np.float32)
    return counts / np.linalg.norm(counts)


def tar_add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uname, info.gname = len(data), MTIME, 0o644, "datacat", "datacat"
    tar.addfile(info, io.BytesIO(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shared", type=Path, default=ROOT / "tests", help="the folder holding data/images")
    parser.add_argument("--out", type=Path, default=ROOT / "catalog" / "sample")
    args = parser.parse_args()
    images = args.shared / "data" / "images"
    if not images.is_dir():
        sys.exit(f"{images} not found: the sample is built from the shared licensed photos")

    samples = []
    for path, caption, licence in PHOTOS:
        photo = rgb(Image.open(images / path))
        for name, suffix in VIEWS:
            buffer = io.BytesIO()
            view(photo, name).save(buffer, "JPEG", quality=82, optimize=True)
            samples.append(
                {
                    "jpg": buffer.getvalue(),
                    "txt": caption + suffix,
                    "meta": {"source": path, "view": name, "license": licence},
                }
            )
    per_shard = -(-len(samples) // len(SHARDS))
    groups = [samples[i * per_shard : (i + 1) * per_shard] for i in range(len(SHARDS))]

    from array_record.python import array_record_module  # the builder alone writes ArrayRecord files

    for sub in ("webdataset", "array_record", "embeddings"):
        (args.out / sub).mkdir(parents=True, exist_ok=True)
    counts = {}
    for shard, group in zip(SHARDS, groups, strict=True):
        tar_path = args.out / "webdataset" / f"{shard:04d}.tar"
        with tarfile.open(tar_path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for index, sample in enumerate(group):
                key = f"{shard:04d}{index:04d}"
                tar_add(tar, f"{key}.jpg", sample["jpg"])
                tar_add(tar, f"{key}.txt", sample["txt"].encode())
                tar_add(tar, f"{key}.json", json.dumps(sample["meta"], sort_keys=True).encode())
        ar_path = args.out / "array_record" / f"{shard:05d}.array_record"
        writer = array_record_module.ArrayRecordWriter(str(ar_path), "group_size:1")
        for index, sample in enumerate(group):
            key = f"{shard:04d}{index:04d}"
            writer.write(
                pack_record(
                    {
                        "key": key,
                        "jpg": sample["jpg"],
                        "txt": sample["txt"],
                        "meta": json.dumps(sample["meta"], sort_keys=True),
                    }
                )
            )
        writer.close()
        np.save(args.out / "embeddings" / f"img_emb_{shard:04d}.npy", np.stack([histogram(s["jpg"]) for s in group]))
        counts[shard] = len(group)
    total = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{len(samples)} samples; per shard {counts}; {total / 1e6:.2f} MB under {args.out}")


if __name__ == "__main__":
    main()
