from __future__ import annotations

import subprocess
import sys

import datacat

# The core install (catalog, validation, describe) has none of these but fsspec, so importing them would break it;
# fsspec is imported with the first read.
HEAVY = (
    *("torch", "jax", "grain", "array_record", "webdataset", "cv2", "tensorflow", "numpy", "PIL", "simplejpeg"),
    *("apache_beam", "fsspec", "pyarrow", "datasets"),  # storage, parquet, Hugging Face and Beam: on first read
)


def test_all_is_sorted_and_complete() -> None:
    assert datacat.__all__ == sorted(datacat.__all__)
    public = {name for name in vars(datacat) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(datacat, name)).__name__ == "module"}
    assert set(datacat.__all__) == public - modules


def _imported_after(code: str) -> set[str]:
    probe = f"import sys; {code}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_import_and_describe_and_list_import_no_framework() -> None:
    loaded = _imported_after(
        "import datacat; from click.testing import CliRunner; from datacat.cli import main; "
        "r = CliRunner().invoke(main, ['describe', 'cc3m']); assert r.exit_code == 0, r.output; "
        "r = CliRunner().invoke(main, ['list']); assert r.exit_code == 0, r.output; datacat.describe('sample')"
    )
    assert not loaded & set(HEAVY), loaded & set(HEAVY)


def test_missing_framework_names_the_extra(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import pytest

    import datacat.backends
    from datacat.registry import Implementation, load_implementation

    monkeypatch.setattr(datacat.backends, "_installed", lambda *modules: False)
    with pytest.raises(datacat.BackendUnavailable, match=r"pip install 'datacat\[torch\]' or 'datacat\[jax\]'"):
        datacat.open("sample", batch_size=4)
    with pytest.raises(datacat.BackendUnavailable, match=r"install me \(not_a_real_package_xyz is not installed\)"):
        load_implementation(Implementation("not_a_real_package_xyz.module:thing", "install me"))
