"""s3:// shards through real s3fs against moto's S3 server (a subprocess): reads, byte ranges, errors, retries, deadline.

The server and the proxy before it are tests/s3_server.py (the ``s3_server``
fixture of conftest.py). The shards are real tars and ArrayRecord files
written here, uploaded to the bucket with s3fs; reads go through the proxy,
which counts each request and its range and fails the ones a test arms.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import noisy_shards

import datacat

pytestmark = pytest.mark.slow  # every test here starts a storage server

SHARDS, PER_SHARD = 2, 24
EXPECTED = sorted(f"{s:02d}{i:04d}" for s in range(SHARDS) for i in range(PER_SHARD))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SHARDS tars and ArrayRecord files of PER_SHARD noisy JPEGs (~18 KB each, ~430 KB a shard) with their captions."""
    folder = noisy_shards(tmp_path_factory.mktemp("s3-shards"), SHARDS, PER_SHARD, size=(120, 160), quality=90)
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


def test_s3_records_are_read_by_their_exact_byte_ranges(s3, shards: Path, tmp_path: Path) -> None:
    """After the open (the tar index, the ArrayRecord chunk index), two records cost two small closed ranges."""
    import re

    from datacat.loading.sources import SampleSource

    catalog = _catalog(tmp_path, "s3://datacat-test", s3.url)
    for name, local in (("star", "tar/0000.tar"), ("sar", "ar/0000.array_record")):
        shard_size = (shards / local).stat().st_size
        reader = SampleSource(datacat.resolve(name, catalog=catalog, image_size=16)).reader
        s3.reset_counts()
        items = reader.items([3, PER_SHARD + 5])
        assert not [item for item in items if isinstance(item, Exception)], items
        if name == "star":
            assert [item.key for item in items] == ["000003", "010005"]
        gets = list(s3.log)
        assert len(gets) == 2 and all(
            m == "GET" and rng and re.fullmatch(r"bytes=\d+-\d+", rng) for m, _, rng in gets
        ), gets
        asked = sum(int(b) - int(a) + 1 for _, _, rng in gets for a, b in [rng.removeprefix("bytes=").split("-")])
        assert asked < shard_size / 8, (name, shard_size, gets)  # two records of ~18 KB, not shards of ~430 KB
        assert s3.bytes_served < asked + 4096, (name, s3.bytes_served, asked)
        if name == "star":  # exactly each sample's span from the tar index
            spans = [reader._span(*reader.locate(i)) for i in (3, PER_SHARD + 5)]
            assert sorted(rng for _, _, rng in gets) == sorted(f"bytes={a}-{b - 1}" for a, b in spans)


def test_s3_missing_object_and_access_denied_are_datacats_errors_naming_the_url(s3, tmp_path: Path) -> None:
    from datacat.loading.sources import SampleSource

    catalog = _catalog(tmp_path, "s3://datacat-test", s3.url)
    for name, shard in (("star", "tar/0000.tar"), ("sar", "ar/0000.array_record")):
        plan = datacat.resolve(name, catalog=catalog, image_size=16, root="s3://datacat-test/nowhere")
        with pytest.raises(FileNotFoundError) as missing:
            SampleSource(plan)
        assert f"s3://datacat-test/nowhere/{shard}" in str(missing.value), missing.value
        assert type(missing.value) is FileNotFoundError and missing.value.filename.startswith("s3://")

        s3.arm(f"/datacat-test/{shard}", "403")
        try:
            started = time.monotonic()
            with pytest.raises(datacat.ShardError) as denied:
                SampleSource(datacat.resolve(name, catalog=catalog, image_size=16))
        finally:
            s3.disarm()
        assert denied.value.url == f"s3://datacat-test/{shard}", denied.value
        assert "PermissionError" in str(denied.value) or "Access Denied" in str(denied.value), denied.value
        assert time.monotonic() - started < 5  # refused: not retried


def test_s3_transient_errors_are_retried_and_every_record_still_comes_once(s3, tmp_path: Path) -> None:
    catalog = _catalog(tmp_path, "s3://datacat-test", s3.url)
    for name, shard in (("star", r"tar/0001\.tar"), ("sar", r"ar/0001\.array_record")):
        s3.reset_counts()
        s3.arm(f"/datacat-test/{shard}", "503", times=3)
        try:
            loader = datacat.open(name, framework="torch", batch_size=8, catalog=catalog)
            keys = [k for batch in loader for k in batch["key"]]
            loader.close()
        finally:
            s3.disarm()
        assert s3.faults == 3, name
        assert sorted(keys) == EXPECTED, name
        assert loader.retries >= 3, (name, loader.retries)


def test_s3_stalled_read_fails_within_the_deadline(s3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from datacat.loading.sources import SampleSource

    monkeypatch.setenv("DATACAT_READ_TIMEOUT", "3")
    monkeypatch.setenv("DATACAT_CONNECT_TIMEOUT", "3")
    catalog = _catalog(tmp_path, "s3://datacat-test", s3.url)
    for name, shard in (("star", "tar/0000.tar"), ("sar", "ar/0000.array_record")):
        s3.arm(f"/datacat-test/{shard}", "stall")
        try:
            started = time.monotonic()
            with pytest.raises(datacat.ShardError) as stalled:
                SampleSource(datacat.resolve(name, catalog=catalog, image_size=16))
            took = time.monotonic() - started
        finally:
            s3.disarm()
        assert stalled.value.url == f"s3://datacat-test/{shard}", stalled.value
        assert "no answer within 3 s" in str(stalled.value), stalled.value
        assert took < 15, (name, took)
