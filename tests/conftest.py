from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Licensed third-party test files (images, tars, ArrayRecords), copied with their SOURCES.md.
SHARED_DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(autouse=True)
def _isolated_catalog_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tests see only the catalogs they name, whatever the developer's shell exports, and a cache of their own."""
    monkeypatch.delenv("DATACAT_CATALOG", raising=False)
    monkeypatch.delenv("DATACAT_ROOT", raising=False)
    monkeypatch.setenv("DATACAT_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def licensed_data() -> Path:
    """tests/data: the licensed third-party test files (their licences and origins in tests/data/SOURCES.md)."""
    return SHARED_DATA


@pytest.fixture
def write_catalog(tmp_path: Path):
    """Writes a YAML text to tmp_path/NAME and returns its path."""

    def write(text: str, name: str = "user.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


def pytest_report_header() -> str:
    return f"test data: {SHARED_DATA}; DATACAT_ROOT={os.environ.get('DATACAT_ROOT')}"


# gcsfs reads this when first imported: without it, newer gcsfs probes the bucket type over
# gRPC and waits 60 s per operation against the emulator (a trap noted in the stack notes).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(scope="session")
def gcs_emulator():
    """A real GCS emulator (gcp-storage-emulator, threaded, suffix ranges as GCS serves them) on 127.0.0.1; yields its URL."""
    pytest.importorskip("gcp_storage_emulator.server", reason="needs gcp-storage-emulator (the [test] extra)")
    from storage_servers import Emulator

    emulator = Emulator().start()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT")}
    os.environ["STORAGE_EMULATOR_HOST"] = emulator.url  # gcsfs
    os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = emulator.url  # array_record's own C++ GCS client
    try:
        yield emulator.url
    finally:
        emulator.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# Hugging Face: a cache of the run's own and never the network (read when datasets is first imported).
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="datacat-test-hf-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


S3_ENV = {
    "AWS_ACCESS_KEY_ID": "datacat-test",  # moto takes any credentials; these keep botocore off ~/.aws and IMDS
    "AWS_SECRET_ACCESS_KEY": "datacat-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """moto's S3 server in a subprocess on 127.0.0.1 with the bucket ``datacat-test``, and a fault proxy before it.

    Yields the :class:`~s3_server.S3Proxy`; ``.upstream_url`` is moto's own URL. Dummy AWS credentials and
    region are set in the environment (worker processes inherit them); the endpoint is each entry's
    ``storage_options: {endpoint_url: ...}``.
    """
    pytest.importorskip("moto.server", reason="needs moto[server] (the [test] extra)")
    s3fs = pytest.importorskip("s3fs", reason="needs s3fs (the [s3] extra)")
    from s3_server import MotoServer, S3Proxy

    saved = {k: os.environ.get(k) for k in S3_ENV}
    os.environ.update(S3_ENV)
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log").start()
    proxy = S3Proxy(server.url).start()
    proxy.upstream_url = server.url  # type: ignore[attr-defined]
    try:
        s3fs.S3FileSystem(endpoint_url=server.url, skip_instance_cache=True).mkdir("datacat-test")
        yield proxy
    finally:
        proxy.stop()
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
