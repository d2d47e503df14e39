"""Tiny real shards for tests: tars (plain or gzipped) and ArrayRecord files in tmp_path."""

from __future__ import annotations

import gzip
import io
import tarfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

WriteCatalog = Callable[..., Path]
"""The ``write_catalog`` fixture: writes a YAML text to tmp_path (``user.yaml`` unless named) and returns its path."""


def jpeg(seed: int, size: tuple[int, int] = (48, 40)) -> bytes:
    """A small real JPEG with content that differs per seed."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(base).resize(size, Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def make_tar(path: Path, members: Iterable[tuple[str, bytes]], *, compress: bool = False) -> Path:
    """A tar of (member path, bytes) in the given order; gzip-compressed but still named as given if asked."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = buffer.getvalue()
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return path


def sample_members(keys: Iterable[str], *, bad: Iterable[str] = ()) -> list[tuple[str, bytes]]:
    """jpg + txt members for each key; keys in ``bad`` get bytes that are not an image."""
    bad = set(bad)
    out = []
    for i, key in enumerate(keys):
        out.append((f"{key}.jpg", b"this is not a jpeg" if key in bad else jpeg(i)))
        out.append((f"{key}.txt", f"caption of {key}".encode()))
    return out


def make_array_record(path: Path, records: Iterable[bytes]) -> Path:
    from array_record.python import array_record_module

    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    for record in records:
        writer.write(record)
    writer.close()
    return path


def read_all(source: Any) -> list[dict[str, Any]]:
    """Every selected sample of a SampleSource in canonical order (one rank, no shuffle), its policy applied."""
    from datacat.loading.epochs import Schedule

    n = len(source)
    view = source.view(Schedule(n, 0, n, (n,)), seed=0, epoch=0, shuffle=False)
    return [s for output in view.finish(view.fetch(range(n))) if (s := source.ledger.admit(output)) is not None]


def sample_at(source: Any, index: int, *, epoch: int = 0) -> dict[str, Any] | None:
    """The sample of a random-access SampleSource at selected position ``index``, or None when ``skip`` dropped it."""
    from datacat.errors import DatacatError, OptionError

    position = source.selection()[index]
    reader = source.reader
    if not reader.random_access:
        raise OptionError(f"{source.plan.name} is read shard by shard: read its samples through an EpochView")
    try:
        (item,) = reader.items([position])
    except (DatacatError, OSError) as exc:
        item = exc
    result: dict[str, Any] | None = source.ledger.admit(source.outcome(item, position, epoch=epoch))
    return result


def draw_sequence(sizes: Sequence[int], weights: Sequence[float], exhaustion: str, key: int) -> np.ndarray:
    """The component drawn at each position of one mixture epoch (uint8), whole."""
    from datacat.loading.mixture import Draws

    draws = Draws(sizes, weights, exhaustion, key)
    return np.concatenate([draws.block(b) for b in range(len(draws.counts))])


def noisy_shards(folder: Path, shards: int, per_shard: int, *, size: tuple[int, int], quality: int) -> Path:
    """tar/NNNN.tar and ar/NNNN.array_record under ``folder``: the same noisy JPEGs (keys ``SSIIII``) and captions.

    Noise does not compress, so a shard's size is what its records make (the remote tests need shards over 1 MB).
    """
    from datacat.formats.packed import pack_record

    (folder / "tar").mkdir()
    (folder / "ar").mkdir()
    for shard in range(shards):
        keys = [f"{shard:02d}{i:04d}" for i in range(per_shard)]
        images = {}
        for k in keys:
            pixels = np.random.default_rng(int(k)).integers(0, 256, size=(*size, 3), dtype=np.uint8)
            buffer = io.BytesIO()
            Image.fromarray(pixels).save(buffer, "JPEG", quality=quality)
            images[k] = buffer.getvalue()
        make_tar(
            folder / "tar" / f"{shard:04d}.tar",
            [m for k in keys for m in ((f"{k}.jpg", images[k]), (f"{k}.txt", f"caption {k}".encode()))],
        )
        make_array_record(
            folder / "ar" / f"{shard:04d}.array_record",
            [pack_record({"jpg": images[k], "txt": f"caption {k}", "key": k}) for k in keys],
        )
    return folder
