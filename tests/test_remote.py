"""gs:// and s3:// shards over 1 MB through a proxy that injects faults: every record exactly once, retries reported.

The GCS emulator (tests/storage_servers.py) serves ranges as GCS does, and
moto's S3 server (tests/s3_server.py) as S3 does; the proxy
in front of it answers 503 to 4 % of requests, cuts every large download
once mid-body and resets 3 % of ranged reads (each framework meets 10-30
faults; gcsfs waits 1-2 s before its first retry of a 503, so more faults
cost test time, not coverage). Each framework and format must
still deliver every record of an epoch exactly once, the same keys as the
local copy, and say how many retries it made.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from helpers import noisy_shards

import datacat

pytestmark = pytest.mark.slow  # every test here starts processes or a storage server

SHARDS, PER_SHARD = 3, 30


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = noisy_shards(tmp_path_factory.mktemp("remote"), SHARDS, PER_SHARD, size=(160, 200), quality=95)
    assert (folder / "ar" / "0000.array_record").stat().st_size > 2**20  # over 1 MB: the suffix-range case
    return folder


@pytest.fixture(scope="module")
def faulty(gcs_emulator: str, shards: Path):
    gcsfs = pytest.importorskip("gcsfs")
    from storage_servers import FaultProxy

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=gcs_emulator)
    if not fs.exists("remote-test"):
        fs.mkdir("remote-test")
    with warnings.catch_warnings():  # aiohttp warns of a large upload body; it is one test upload
        warnings.simplefilter("ignore", ResourceWarning)
        for path in sorted(shards.rglob("*")):
            if path.is_file() and path.suffix != ".yaml":
                fs.pipe(f"remote-test/{path.relative_to(shards)}", path.read_bytes())
    proxy = FaultProxy(gcs_emulator, fail_rate=0.04, cut_large=True, reset_rate=0.03, seed=7).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def faulty_s3(s3_server: Any, shards: Path):
    """The same shards in moto's bucket, behind a proxy making the same random faults."""
    import s3fs
    from s3_server import S3Proxy

    fs = s3fs.S3FileSystem(endpoint_url=s3_server.upstream_url, skip_instance_cache=True)
    for path in sorted(shards.rglob("*")):
        if path.is_file() and path.suffix != ".yaml":
            fs.pipe(f"datacat-test/remote-test/{path.relative_to(shards)}", path.read_bytes())
    proxy = S3Proxy(s3_server.upstream_url, fail_rate=0.04, cut_large=True, reset_rate=0.03, seed=7).start()
    yield proxy
    proxy.stop()


@pytest.fixture(params=["gs", "s3"])
def bucket(request: pytest.FixtureRequest) -> tuple[str, Any, dict[str, str]]:
    """(root, fault proxy, environment) of the shards on the GCS emulator or on moto's S3 server."""
    if request.param == "gs":
        proxy = request.getfixturevalue("faulty")
        return "gs://remote-test", proxy, {"CLOUD_STORAGE_EMULATOR_ENDPOINT": proxy.url}
    return "s3://datacat-test/remote-test", request.getfixturevalue("faulty_s3"), {}


def _catalog(folder: Path, root: str, endpoint: str | None) -> Path:
    token = "token: anon, " if root.startswith("gs://") else ""
    options = f", storage_options: {{{token}endpoint_url: '{endpoint}'}}" if endpoint else ""
    path = folder / "remote.yaml"
    path.write_text(
        f"rtar: {{description: d, format: webdataset, location: {{root: '{root}', path: tar, shards: '{{0000..0002}}.tar'{options}}}, loading: {{val_batches: 0, image_size: 32}}}}\n"
        f"rar: {{description: d, format: array_record, location: {{root: '{root}', path: ar, shards: '{{0000..0002}}.array_record'{options}}}, "
        "record: {layout: packed, key: key}, loading: {val_batches: 0, image_size: 32}}\n"
    )
    return path


def test_every_record_once_under_faults_in_both_frameworks(
    bucket: tuple[str, Any, dict[str, str]], shards: Path, tmp_path: Path
) -> None:
    from test_backends import run_ranks

    root, faulty, bucket_env = bucket
    local = _catalog(shards, str(shards), None)
    expected = {f"{s:02d}{i:04d}" for s in range(SHARDS) for i in range(PER_SHARD)}
    for name in ("rtar", "rar"):
        keys = [
            k
            for b in datacat.open(name, framework="torch", batch_size=8, catalog=datacat.load_catalog([local]))
            for k in b["key"]
        ]
        assert sorted(keys) == sorted(expected), name
    remote = _catalog(tmp_path, root, faulty.url)
    env = {"DATACAT_CATALOG": str(remote), **bucket_env}
    loads = [{"name": n, "batch_size": 8, "num_workers": 2, "seed": 1, "epochs": 1} for n in ("rtar", "rar")]
    for framework in ("torch", "jax"):
        faulty.reset_counts()
        results = run_ranks(framework, [loads], env=env)[0]
        for name, result in zip(("rtar", "rar"), results, strict=True):
            keys = [k for b in result["batches"] for k in b]
            assert sorted(keys) == sorted(expected), (framework, name)
        assert faulty.faults > 0
        assert sum(r["retries"] for r in results) > 0, f"{framework}: no retries reported under {faulty.faults} faults"


def test_after_verify_a_glob_entry_opens_with_no_listing_or_footer_read(
    faulty, gcs_emulator: str, tmp_path: Path
) -> None:
    import os
    import subprocess
    import sys

    from storage_servers import FaultProxy

    clean = FaultProxy(gcs_emulator).start()
    try:
        catalog = tmp_path / "glob.yaml"
        catalog.write_text(
            "gar: {description: d, format: array_record, location: {root: 'gs://remote-test', path: ar, "
            f"shards: '*.array_record', storage_options: {{token: anon, endpoint_url: '{clean.url}'}}}}, "
            "record: {layout: packed, key: key}, loading: {val_batches: 0, image_size: 16}}\n"
        )
        env = {
            **os.environ,
            "DATACAT_CATALOG": str(catalog),
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": clean.url,
            "PYTHONWARNINGS": "ignore",
        }
        verified = subprocess.run(
            [sys.executable, "-c", "from datacat.cli import main; main()", "verify", "gar"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert any(path.endswith("/o") or "/o?" in path for _, path, _ in clean.log)  # verify listed the folder
        clean.reset_counts()
        code = (
            "import datacat\n"
            "assert datacat.describe('gar')['shard_count'] == 3\n"
            "loader = datacat.open('gar', framework='torch', batch_size=8)\n"
            "print('BATCHES', len(loader), flush=True)\n"
            "print('KEYS', len(next(iter(loader))['key']), flush=True)\n"
        )
        opened = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert "BATCHES 12" in opened.stdout and "KEYS 8" in opened.stdout, opened.stderr[-2000:]
        # No listing, no metadata, no footer: only the records' own byte ranges, each closed at both ends.
        assert clean.log and all(
            method == "GET" and "alt=media" in path and rng and re.fullmatch(r"bytes=\d+-\d+", rng)
            for method, path, rng in clean.log
        ), clean.log
    finally:
        clean.stop()


DEADLINE_PROBE = """
import sys, time
import datacat
name, framework = sys.argv[1], sys.argv[2]
started = time.monotonic()
try:
    next(iter(datacat.open(name, framework=framework, batch_size=8)))
except datacat.ShardError as exc:
    print("CAUGHT", round(time.monotonic() - started), exc.url, "|", exc)
"""


@pytest.mark.parametrize("root", ["gs://remote-test", "s3://datacat-test/remote-test"])
def test_storage_that_never_answers_is_an_error_within_the_deadline(tmp_path: Path, root: str) -> None:
    import os
    import socket
    import subprocess
    import sys

    # A listening socket nobody accepts from: connections succeed in the kernel, no byte ever comes back.
    with socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(128)
        url = f"http://127.0.0.1:{hole.getsockname()[1]}"
        env = {
            **os.environ,
            "DATACAT_CATALOG": str(_catalog(tmp_path, root, url)),
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,
            "DATACAT_READ_TIMEOUT": "2",
            "DATACAT_CONNECT_TIMEOUT": "2",
            "PYTHONWARNINGS": "ignore",
        }
        for name, framework in (("rtar", "torch"), ("rar", "jax")):
            done = subprocess.run(
                [sys.executable, "-c", DEADLINE_PROBE, name, framework],
                env=env,
                capture_output=True,
                text=True,
                timeout=180,
            )
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("CAUGHT ")), None)
            assert line is not None, (name, done.stdout[-1000:], done.stderr[-3000:])
            seconds, where = line.split()[1:3]
            assert where.startswith(root + "/") and "no answer within 2 s" in line, line
            assert int(seconds) <= 12, line
