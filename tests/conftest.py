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
