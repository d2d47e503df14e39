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
