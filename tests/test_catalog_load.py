"""Loading catalogs from Python: one path or several, and what a missing one is called."""

from __future__ import annotations

from pathlib import Path

import pytest

from datacat import CatalogError, load_catalog

ENTRY = "mine:\n  description: d\n  format: webdataset\n  location: {root: /d, shards: '{0..1}.tar'}\n"


@pytest.mark.parametrize("as_type", [str, Path])
def test_a_single_path_is_one_file(tmp_path: Path, as_type: type) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(ENTRY)
    catalog = load_catalog(as_type(path))
    assert "mine" in catalog and "cc3m" in catalog


def test_a_missing_single_path_is_one_problem_naming_the_argument(tmp_path: Path) -> None:
    missing = str(tmp_path / "mine.yaml")
    with pytest.raises(CatalogError) as caught:
        load_catalog(missing)
    message = str(caught.value)
    assert message.count("no such catalog file or folder") == 1
    assert "mine.yaml" in message and "load_catalog(paths=...)" in message
    assert "--catalog" not in message


def test_a_list_of_paths_still_loads_each(tmp_path: Path) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(ENTRY)
    second.write_text(ENTRY.replace("mine", "yours"))
    catalog = load_catalog([first, str(second)])
    assert {"mine", "yours"} <= set(catalog)
