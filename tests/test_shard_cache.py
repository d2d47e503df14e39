"""The node-local shard cache over gs:// and s3:// behind an 80 ms proxy: no request once cached, a cap, damage, one download.

The shards are real tars and ArrayRecord files (helpers.noisy_shards) on
the GCS emulator and on moto's S3 server, read through a proxy that delays
every first byte by 80 ms (a bucket's latency) and logs every request.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from helpers import noisy_shards

import datacat
from datacat.errors import OptionError
from datacat.storage.shard_cache import ShardCache, parse_bytes, read_seal
from datacat.storage.shard_fill import md5_hex

SHARDS, PER_SHARD = 3, 20
EXPECTED = sorted(f"{s:02d}{i:04d}" for s in range(SHARDS) for i in range(PER_SHARD))


def test_sizes_and_checksums_are_read_as_written() -> None:
    assert parse_bytes("200GB") == 200 * 10**9 and parse_bytes("1.5 KiB") == 1536 and parse_bytes(7) == 7
    with pytest.raises(OptionError, match="not a size"):
        parse_bytes("lots")
    digest = hashlib.md5(b"x").hexdigest()
    import base64

    for form in (f"md5:{digest}", f'"{digest}"', base64.b64encode(bytes.fromhex(digest)).decode()):
        assert md5_hex(form) == digest, form
    assert md5_hex("AAAAAA==") is None and md5_hex(f'"{digest}-2"') is None  # crc32c, a multipart ETag


def test_the_environment_names_a_cache_only_with_its_cap(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("DATACAT_SHARD_CACHE", raising=False)
    assert ShardCache.from_env() is None
    monkeypatch.setenv("DATACAT_SHARD_CACHE", str(tmp_path))
    with pytest.raises(OptionError, match="DATACAT_SHARD_CACHE_BYTES"):
        ShardCache.from_env()
    monkeypatch.setenv("DATACAT_SHARD_CACHE_BYTES", "2MB")
    assert ShardCache.from_env() == ShardCache(str(tmp_path), 2_000_000)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return noisy_shards(tmp_path_factory.mktemp("cache-shards"), SHARDS, PER_SHARD, size=(120, 160), quality=90)


@pytest.fixture(scope="module")
def gs_bucket(gcs_emulator: str, shards: Path):
    import gcsfs
    from storage_servers import FaultProxy

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=gcs_emulator)
    if not fs.exists("cache-test"):
        fs.mkdir("cache-test")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        for path in sorted(shards.rglob("*")):
            if path.is_file() and path.suffix != ".yaml":
                fs.pipe(f"cache-test/{path.relative_to(shards)}", path.read_bytes())
    proxy = FaultProxy(gcs_emulator, delay=0.08).start()
    yield "gs://cache-test", proxy
    proxy.stop()


@pytest.fixture(scope="module")
def s3_bucket(s3_server: Any, shards: Path):
    import s3fs
    from s3_server import S3Proxy

    fs = s3fs.S3FileSystem(endpoint_url=s3_server.upstream_url, skip_instance_cache=True)
    for path in sorted(shards.rglob("*")):
        if path.is_file() and path.suffix != ".yaml":
            fs.pipe(f"datacat-test/cache-test/{path.relative_to(shards)}", path.read_bytes())
    proxy = S3Proxy(s3_server.upstream_url, delay=0.08).start()
    yield "s3://datacat-test/cache-test", proxy
    proxy.stop()


@pytest.fixture(params=["gs", "s3"])
def bucket(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """(root, latency proxy) of the shards on the GCS emulator or on moto."""
    return request.getfixturevalue(f"{request.param}_bucket")  # type: ignore[no-any-return]


def _catalog(folder: Path, root: str, proxy: Any) -> Path:
    token = "token: anon, " if root.startswith("gs://") else ""
    options = f", storage_options: {{{token}endpoint_url: '{proxy.url}'}}"
    path = folder / "cached.yaml"
    path.write_text(
        f"ctar: {{description: d, format: webdataset, location: {{root: '{root}', path: tar, shards: '{{0000..0002}}.tar'{options}}}, loading: {{val_batches: 0, image_size: 16}}}}\n"
        f"car: {{description: d, format: array_record, location: {{root: '{root}', path: ar, shards: '{{0000..0002}}.array_record'{options}}}, "
        "record: {layout: packed, key: key}, loading: {val_batches: 0, image_size: 16}}\n"
    )
    return path


def _epoch(name: str, catalog: Path, cache: ShardCache, **options: Any) -> tuple[list[str], datacat.Loader]:
    loader = datacat.open(
        name, framework="torch", batch_size=8, catalog=datacat.load_catalog([catalog]), shard_cache=cache, **options
    )
    keys = [k for batch in loader for k in batch["key"]]
    assert loader.filler is not None  # type: ignore[attr-defined]
    loader.filler.join(120)  # type: ignore[attr-defined]
    return keys, loader


def _object_ranges(proxy: Any) -> list[tuple[str, str | None]]:
    """(object, Range) of each media GET the proxy saw."""
    out = []
    for method, path, rng in proxy.log:
        if method == "GET" and ("alt=media" in path or "/cache-test/" in path):
            name = re.search(r"(tar|ar)(?:/|%2F)(\d{4}\.\w+)", path)
            out.append((name.group(0).replace("%2F", "/") if name else path, rng))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["car", "ctar"])
def test_a_cached_shard_costs_no_request(bucket: tuple[str, Any], name: str, tmp_path: Path) -> None:
    root, proxy = bucket
    catalog, cache = _catalog(tmp_path, root, proxy), ShardCache(str(tmp_path / "cache"), "1GB")
    keys, _ = _epoch(name, catalog, cache)
    assert sorted(keys) == EXPECTED
    assert cache.usage().shards == SHARDS
    proxy.reset_counts()
    again, _ = _epoch(name, catalog, cache, num_workers=2)
    assert sorted(again) == EXPECTED
    assert proxy.requests == 0, proxy.log
    info = subprocess.run(
        [sys.executable, "-m", "datacat", "cache", "info", "--dir", cache.folder], capture_output=True, text=True
    )
    assert f"shards:   {SHARDS} " in info.stdout and "cap:      953.7 MiB" in info.stdout, info.stdout + info.stderr
    cleared = subprocess.run([sys.executable, "-m", "datacat", "cache", "clear", "--dir", cache.folder], text=True)
    assert cleared.returncode == 0 and cache.usage().shards == 0


@pytest.mark.slow
def test_a_cap_below_the_set_keeps_the_folder_under_it(bucket: tuple[str, Any], shards: Path, tmp_path: Path) -> None:
    root, proxy = bucket
    sizes = [p.stat().st_size for p in sorted((shards / "ar").glob("*.array_record"))]
    cap = sizes[0] + sizes[1] + 4096  # two shards and their seals, not three
    catalog, cache = _catalog(tmp_path, root, proxy), ShardCache(str(tmp_path / "cache"), cap)
    for _ in range(2):
        keys, _ = _epoch("car", catalog, cache)
        assert sorted(keys) == EXPECTED
        total = sum(p.stat().st_size for p in Path(cache.folder).iterdir() if p.name != ".lock")
        assert total <= cap
        assert cache.usage().shards == 2
    # Another plan's shards evict the least recently read ones, and stay under the cap too.
    keys, _ = _epoch("ctar", catalog, cache)
    assert sorted(keys) == EXPECTED
    assert sum(p.stat().st_size for p in Path(cache.folder).iterdir() if p.name != ".lock") <= cap


@pytest.mark.slow
def test_a_damaged_copy_is_never_served_and_is_fetched_again(
    bucket: tuple[str, Any], shards: Path, tmp_path: Path
) -> None:
    root, proxy = bucket
    catalog, cache = _catalog(tmp_path, root, proxy), ShardCache(str(tmp_path / "cache"), "1GB")
    _epoch("car", catalog, cache)
    url = f"{root}/ar/0001.array_record"
    copy = cache.path(url)
    with open(copy, "r+b") as f:  # a flipped byte in the middle of a record
        f.seek(os.path.getsize(copy) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    proxy.reset_counts()
    keys, _ = _epoch("car", catalog, cache)
    assert sorted(keys) == EXPECTED  # a record read from the bad copy would fail to decode, or be another
    assert any(obj == "ar/0001.array_record" for obj, _ in _object_ranges(proxy))  # read, then fetched again
    assert not any(obj == "ar/0000.array_record" for obj, _ in _object_ranges(proxy))  # the sound ones not
    seal = read_seal(copy)
    assert (
        seal is not None and seal["md5"] == hashlib.md5((shards / "ar" / "0001.array_record").read_bytes()).hexdigest()
    )
    assert hashlib.md5(Path(copy).read_bytes()).hexdigest() == seal["md5"]


TWO_LOADERS = """
import json, sys
import datacat
loader = datacat.open(sys.argv[1], framework="torch", batch_size=8, num_workers=2)
keys = [k for batch in loader for k in batch["key"]]
loader.filler.join(120)
print("KEYS " + json.dumps(keys), flush=True)
print("DOWNLOADED", loader.filler.downloaded, flush=True)
"""


@pytest.mark.slow
def test_two_loaders_with_two_workers_each_download_each_shard_once(
    bucket: tuple[str, Any], shards: Path, tmp_path: Path
) -> None:
    root, proxy = bucket
    catalog = _catalog(tmp_path, root, proxy)
    env = {
        **os.environ,
        "DATACAT_CATALOG": str(catalog),
        "DATACAT_SHARD_CACHE": str(tmp_path / "cache"),
        "DATACAT_SHARD_CACHE_BYTES": "1GB",
        "PYTHONWARNINGS": "ignore",
    }
    proxy.reset_counts()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_LOADERS, "car"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    downloaded = 0
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        keys = json.loads(next(line for line in out.splitlines() if line.startswith("KEYS "))[5:])
        assert sorted(keys) == EXPECTED
        downloaded += int(next(line for line in out.splitlines() if line.startswith("DOWNLOADED ")).split()[1])
    assert downloaded == SHARDS  # each shard by one of the two loaders, the other finding it downloading or done
    # Each download is one range per 8 MB from byte 0; the loaders' own reads are records' and footers' ranges.
    sizes = {f"ar/{p.name}": p.stat().st_size for p in (shards / "ar").glob("*.array_record")}
    seals = [read_seal(str(p)[: -len(".ok")]) for p in Path(tmp_path / "cache").glob("*.ok")]
    assert sorted(
        str(seal["url"]).rsplit("/", 2)[-2] + "/" + str(seal["url"]).rsplit("/", 1)[-1] for seal in seals if seal
    ) == sorted(sizes)
    assert len(list(Path(tmp_path / "cache").glob("*.array_record"))) == SHARDS
