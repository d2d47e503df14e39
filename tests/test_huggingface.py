"""Hugging Face datasets: a local parquet dataset written here (never the network), read through `datasets`.

conftest points HF_HOME at a temporary folder and sets HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import jpeg

import datacat

ROWS = 23


def _dataset(folder: Path) -> list[str]:
    datasets = pytest.importorskip("datasets", reason="needs datasets (the [hf] extra)")
    datasets.disable_progress_bars()
    texts = [f"a picture numbered {i}" for i in range(ROWS)]
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    table = datasets.Dataset.from_dict(
        {"image": [{"bytes": jpeg(i), "path": None} for i in range(ROWS)], "text": texts}, features=features
    )
    (folder / "data").mkdir(parents=True)
    table.to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    return texts


def _catalog(tmp_path: Path, root: str, extra: str = "") -> datacat.Catalog:
    (tmp_path / "hf.yaml").write_text(
        f"hfset: {{description: d, format: huggingface, location: {{root: '{root}', shards: [train]}}{extra}, "
        "loading: {val_batches: 0, image_size: 16, augmentation: flip_only}}\n"
    )
    return datacat.load_catalog([tmp_path / "hf.yaml"], builtin=False)


def test_a_local_parquet_dataset_gives_the_same_keys_and_pixels_in_both_frameworks(tmp_path: Path) -> None:
    texts = _dataset(tmp_path / "set")
    catalog = _catalog(tmp_path, "set", f", totals: {{per_shard: {{train: {ROWS}}}}}")
    runs = {}
    for framework in ("torch", "jax"):
        loader = datacat.open("hfset", framework=framework, batch_size=4, catalog=catalog, epochs=1, seed=3)
        got = {}
        for batch in loader:
            for key, caption, image in zip(batch["key"], batch["caption"], np.asarray(batch["image"]), strict=True):
                got[key] = (caption, image)
        runs[framework] = got
    every = {f"train:{i}" for i in range(ROWS)}
    assert set(runs["torch"]) == set(runs["jax"]) == every  # each row once an epoch
    for key, (caption, image) in runs["torch"].items():
        assert caption == texts[int(key.split(":")[1])]  # the 'text' column, found without being named
        assert image.shape == (16, 16, 3)
        np.testing.assert_array_equal(runs["jax"][key][1], image)  # the same pixels (flip draws included)


def test_a_hugging_face_loader_resumes_exactly(tmp_path: Path) -> None:
    _dataset(tmp_path / "set")
    catalog = _catalog(tmp_path, "set")
    whole = [
        k for b in datacat.open("hfset", framework="torch", batch_size=4, catalog=catalog, seed=5) for k in b["key"]
    ]
    loader = datacat.open("hfset", framework="torch", batch_size=4, catalog=catalog, seed=5)
    iterator = iter(loader)
    head = [k for _ in range(2) for k in next(iterator)["key"]]
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = datacat.open("hfset", framework="torch", batch_size=4, catalog=catalog, seed=5)
    resumed.load_state_dict(state)
    assert head + [k for b in resumed for k in b["key"]] == whole


def test_a_hub_dataset_not_in_the_cache_offline_says_what_to_run(tmp_path: Path) -> None:
    pytest.importorskip("datasets", reason="needs datasets (the [hf] extra)")
    catalog = _catalog(tmp_path, "hf://datasets/datacat-test/never-downloaded@v1")
    with pytest.raises(datacat.ShardError) as caught:
        datacat.open("hfset", framework="torch", batch_size=4, catalog=catalog)
    message = str(caught.value)
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE=1" in message
    assert "datasets.load_dataset('datacat-test/never-downloaded', split='train', revision='v1')" in message


def test_a_column_of_several_captions_gives_the_first(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="needs datasets (the [hf] extra)")
    datasets.disable_progress_bars()
    features = datasets.Features({"image": datasets.Image(), "caption": datasets.Sequence(datasets.Value("string"))})
    table = datasets.Dataset.from_dict(
        {
            "image": [{"bytes": jpeg(i), "path": None} for i in range(3)],
            "caption": [[f"first {i}", "second"] for i in range(3)],
        },
        features=features,
    )
    (tmp_path / "set" / "data").mkdir(parents=True)
    table.to_parquet(str(tmp_path / "set" / "data" / "train-00000-of-00001.parquet"))
    catalog = _catalog(tmp_path, "set")
    batch = next(iter(datacat.open("hfset", framework="torch", batch_size=3, catalog=catalog, shuffle=False)))
    assert sorted(batch["caption"]) == ["first 0", "first 1", "first 2"]


def test_hub_ids_name_repo_revision_and_config() -> None:
    from datacat.formats.huggingface import hub_id

    assert hub_id("hf://datasets/owner/name") == ("owner/name", None, None)
    assert hub_id("hf://datasets/owner/name@abc123/en") == ("owner/name", "abc123", "en")
    assert hub_id("/data/local") is None
    with pytest.raises(ValueError, match="names no dataset"):
        hub_id("hf://datasets/owner")


def test_datacat_count_prints_each_splits_rows(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from datacat.cli import main

    _dataset(tmp_path / "set")
    _catalog(tmp_path, "set")
    done = CliRunner().invoke(main, ["count", "hfset"], env={"DATACAT_CATALOG": str(tmp_path / "hf.yaml")})
    assert done.exit_code == 0, done.output
    assert f"per_shard: {{train: {ROWS}}}" in done.output


def _two_parquet_files(folder: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="needs datasets (the [hf] extra)")
    features = datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
    (folder / "data").mkdir(parents=True)
    for part, rows in enumerate((range(0, 7), range(7, 12))):
        table = datasets.Dataset.from_dict(
            {"image": [{"bytes": jpeg(i), "path": None} for i in rows], "text": [f"picture {i}" for i in rows]},
            features=features,
        )
        table.to_parquet(str(folder / "data" / f"train-{part:05d}-of-00002.parquet"))


def test_parquet_files_named_as_shards_validate_count_and_load_each_row_once(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from datacat.cli import main

    _two_parquet_files(tmp_path / "set")
    shards = "[data/train-00000-of-00002.parquet, data/train-00001-of-00002.parquet]"
    (tmp_path / "hf.yaml").write_text(
        f"hfset: {{description: d, format: huggingface, location: {{root: set, shards: {shards}}}, "
        "loading: {val_batches: 0, image_size: 16}}\n"
    )
    env = {"DATACAT_CATALOG": str(tmp_path / "hf.yaml")}
    validated = CliRunner().invoke(main, ["validate"], env=env)
    assert validated.exit_code == 0, validated.output
    counted = CliRunner().invoke(main, ["count", "hfset"], env=env)
    assert counted.exit_code == 0, counted.output
    assert "data/train-00000-of-00002.parquet: 7, data/train-00001-of-00002.parquet: 5" in counted.output

    catalog = datacat.load_catalog([tmp_path / "hf.yaml"], builtin=False)
    loader = datacat.open("hfset", framework="torch", batch_size=5, catalog=catalog, shuffle=False)
    captions = [c for batch in loader for c in batch["caption"]]
    assert sorted(captions) == sorted(f"picture {i}" for i in range(12))  # every row, once


def test_a_shard_that_is_neither_a_split_nor_a_parquet_file_is_refused_at_validate(tmp_path: Path) -> None:
    (tmp_path / "hf.yaml").write_text(
        "hfset:\n  description: d\n  format: huggingface\n  location: {root: set, shards: [data/train-00000.arrow]}\n"
    )
    with pytest.raises(datacat.CatalogError) as raised:
        datacat.load_catalog([tmp_path / "hf.yaml"], builtin=False)
    message = str(raised.value)
    assert "hf.yaml:4" in message and "hfset.location.shards" in message
    assert "shards: [train]" in message  # the fix
