"""s3:// shards through real s3fs against moto's S3 server (a subprocess): reads, byte ranges, errors, retries, deadline.

The server and the proxy before it are tests/s3_server.py (the ``s3_server``
fixture of conftest.py). The shards are real tars and ArrayRecord files
written here, uploaded to the bucket with s3fs; reads go through the proxy,
which counts each request and its range and fails the ones a test arms.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import make_array_record, make_tar
from PIL import Image

import datacat

pytestmark = pytest.mark.slow  # every test here starts a storage server

SHARDS, PER_SHARD = 2, 24
EXPECTED = sorted(f"{s:02d}{i:04d}" for s in range(SHARDS) for i in range(PER_SHARD))


def _noisy_jpeg(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(120, 160, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SHARDS tars and ArrayRecord files of PER_SHARD noisy JPEGs (~0.8 MB a shard) with their captions."""
    from datacat.formats.packed import pack_record

    folder = tmp_path_factory.mktemp("s3-shards")
    (folder / "tar").mkdir()
    (folder / "ar").mkdir()
    for shard in range(SHARDS):
        keys = [f"{shard:02d}{i:04d}" for i in range(PER_SHARD)]
        images = {k: _noisy_jpeg(int(k)) for k in keys}
        make_tar(
            folder / "tar" / f"{shard:04d}.tar",
            [m for k in keys for m in ((f"{k}.jpg", images[k]), (f"{k}.txt", f"caption {k}".encode()))],
        )
        make_array_record(
            folder / "ar" / f"{shard:04d}.array_record",
            [pack_record({"jpg": images[k], "txt": f"caption {k}", "key": k}) for k in keys],
        )
    return folder


@pytest.fixture(scope="module")
def s3(s3_server, shards: Path):
    """The proxy to moto, the shards uploaded to s3://datacat-test/ through moto's own endpoint."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_server.upstream_url, skip_instance_cache=True)
    for path in sorted(shards.rglob("*")):
        if path.is_file():
            fs.pipe(f"datacat-test/{path.relative_to(shards)}", path.read_bytes())
    return s3_server


def _catalog(folder: Path, root: str, endpoint: str | None = None, name: str = "s3.yaml") -> datacat.Catalog:
    options = f", storage_options: {{endpoint_url: '{endpoint}'}}" if endpoint else ""
    path = folder / name
    path.write_text(
        f"star: {{description: d, format: webdataset, location: {{root: '{root}', path: tar, shards: '{{0000..0001}}.tar'{options}}}, loading: {{val_batches: 0, image_size: 16}}}}\n"
        f"sar: {{description: d, format: array_record, location: {{root: '{root}', path: ar, shards: '{{0000..0001}}.array_record'{options}}}, "
        "record: {layout: packed, key: key}, loading: {val_batches: 0, image_size: 16}}\n"
    )
    return datacat.load_catalog([path], builtin=False)


def _keys(name: str, catalog: datacat.Catalog, **options: object) -> list[str]:
    loader = datacat.open(name, framework="torch", batch_size=8, catalog=catalog, **options)
    try:
        return [k for batch in loader for k in batch["key"]]
    finally:
        loader.close()


def test_s3_entries_deliver_every_record_once_as_the_local_copy(s3, shards: Path, tmp_path: Path) -> None:
    local = _catalog(shards, str(shards))
    remote = _catalog(tmp_path, "s3://datacat-test", s3.url)
    for name in ("star", "sar"):
        assert sorted(_keys(name, local, shuffle=False)) == EXPECTED, name
        for workers in (0, 2):
            keys = _keys(name, remote, num_workers=workers)
            assert sorted(keys) == EXPECTED, (name, workers)
