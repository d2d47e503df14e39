from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parent.parent.parent / "shared"
SHARED_DATA = SHARED / "data"


@pytest.fixture(autouse=True)
def _isolated_catalog_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see only the catalogs they name, whatever the developer's shell exports."""
    monkeypatch.delenv("DATACAT_CATALOG", raising=False)
    monkeypatch.delenv("DATACAT_ROOT", raising=False)


@pytest.fixture
def shared_data() -> Path:
    """../shared/data, the licensed third-party test files; skips where it is absent (as for users)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent: the shared third-party test data is only on developer and CI machines")
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
    return f"shared test data: {'present' if SHARED_DATA.is_dir() else 'absent'}; DATACAT_ROOT={os.environ.get('DATACAT_ROOT')}"


# gcsfs reads this when first imported: without it, newer gcsfs probes the bucket type over
# gRPC and waits 60 s per operation against the emulator (../shared/STACK.md).
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(scope="session")
def gcs_emulator():
    """A real GCS emulator (gcp-storage-emulator) on 127.0.0.1, in this process; yields its URL."""
    server_module = pytest.importorskip(
        "gcp_storage_emulator.server", reason="needs gcp-storage-emulator (the [test] extra)"
    )
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_module.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT")}
    os.environ["STORAGE_EMULATOR_HOST"] = url  # gcsfs
    os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = url  # array_record's own C++ GCS client
    try:
        yield url
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
