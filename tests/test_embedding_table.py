"""Embedding tables for a diffusion prior: three generated file triples, as clip-retrieval writes them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import datacat

DIM, ROWS = 16, (30, 25, 17)  # 72 rows; validation rows 60..72


def _tables(folder: Path, *, zero_row: int | None = None) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    for sub in ("img_emb", "text_emb", "metadata"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    row = 0
    for shard, n in enumerate(ROWS):
        image = np.stack([np.full(DIM, row + i + 1, dtype=np.float16) for i in range(n)])
        if zero_row is not None and row <= zero_row < row + n:
            image[zero_row - row] = 0
        np.save(folder / "img_emb" / f"img_emb_{shard:04d}.npy", image)
        np.save(folder / "text_emb" / f"text_emb_{shard:04d}.npy", -image)
        captions = pa.table({"caption": [f"row {row + i}" for i in range(n)]})
        pq.write_table(captions, folder / "metadata" / f"metadata_{shard:04d}.parquet")
        row += n


def _catalog(folder: Path, extra: str = "") -> Path:
    path = folder / "prior.yaml"
    path.write_text(
        "prior: {description: d, format: embedding_table, location: {root: '.', shards: '{0000..0002}'}, "
        f"prior: {{dim: {DIM}, dtype: float16, validation_rows: [60, 72]{extra}}}}}\n"
    )
    return path


def _row(key: str) -> int:
    shard, row = key.split(":")
    return sum(ROWS[: int(shard)]) + int(row)


@pytest.mark.slow
def test_every_row_once_over_ranks_and_workers_and_the_validation_rows_never_move(tmp_path: Path) -> None:
    from test_backends import run_ranks

    _tables(tmp_path)
    env = {"DATACAT_CATALOG": str(_catalog(tmp_path))}
    for framework, world in (("torch", 4), ("jax", 2)):  # each jax rank spawns its workers: 2 x 2 boots on 2 cores
        loads = [
            [
                {
                    "name": "prior",
                    "batch_size": 3,
                    "num_workers": 2,
                    "world_size": world,
                    "rank": r,
                    "seed": 2,
                    "epochs": 1,
                }
            ]
            for r in range(world)
        ]
        keys = [k for rank in run_ranks(framework, loads, env=env) for b in rank[0]["batches"] for k in b]
        assert sorted(_row(k) for k in keys) == list(range(60)), framework  # every training row once, none held
    for world in (1, 2, 4):
        catalog = datacat.load_catalog([_catalog(tmp_path)], builtin=False)
        held = [
            _row(k)
            for rank in range(world)
            for b in datacat.open(
                "prior",
                framework="torch",
                batch_size=2,
                catalog=catalog,
                split="validation",
                world_size=world,
                rank=rank,
            )
            for k in b["key"]
        ]
        assert sorted(held) == list(range(60, 72)), world


def test_a_batch_holds_both_embeddings_and_captions_and_a_zero_row_is_ledgered(tmp_path: Path) -> None:
    _tables(tmp_path, zero_row=7)
    catalog = datacat.load_catalog([_catalog(tmp_path)], builtin=False)
    for framework in ("torch", "jax"):
        loader = datacat.open(
            "prior", framework=framework, batch_size=4, catalog=catalog, on_bad_sample="skip", bad_sample_budget=0.1
        )
        seen = []
        for batch in loader:
            assert "image" not in batch
            image, text = np.asarray(batch["image_embedding"]), np.asarray(batch["text_embedding"])
            assert image.shape[1:] == (DIM,) and image.dtype == np.float16  # as the table stores it
            for key, caption, im, tx in zip(batch["key"], batch["caption"], image, text, strict=True):
                row = _row(key)
                assert caption == f"row {row}" and (im == row + 1).all() and (tx == -(row + 1)).all()
                seen.append(row)
        assert sorted(seen) == [r for r in range(60) if r != 7], framework
        bad = loader.ledger.skipped
        assert [(b.key, "all zeros" in b.reason) for b in bad] == [("0000:7", True)], framework


def test_an_unconditioned_prior_reads_the_image_side_only(tmp_path: Path) -> None:
    _tables(tmp_path)
    for sub in ("text_emb", "metadata"):
        for f in (tmp_path / sub).iterdir():
            f.unlink()
    catalog = datacat.load_catalog([_catalog(tmp_path, ", text: false, captions: false")], builtin=False)
    batch = next(iter(datacat.open("prior", framework="torch", batch_size=5, catalog=catalog)))
    assert set(batch) >= {"image_embedding", "key"} and not {"text_embedding", "caption"} & set(batch)


def test_misaligned_or_pickled_tables_are_refused_naming_the_file(tmp_path: Path) -> None:
    _tables(tmp_path)
    catalog = datacat.load_catalog([_catalog(tmp_path)], builtin=False)
    np.save(tmp_path / "text_emb" / "text_emb_0001.npy", np.zeros((24, DIM), dtype=np.float16))
    with pytest.raises(datacat.ShardError, match=r"text_emb_0001\.npy has 24 rows, .*img_emb_0001\.npy has 25"):
        datacat.open("prior", framework="torch", batch_size=4, catalog=catalog)
    np.save(tmp_path / "text_emb" / "text_emb_0001.npy", np.array([{"x": 1}] * 25, dtype=object), allow_pickle=True)
    with pytest.raises(datacat.ShardError, match=r"text_emb_0001\.npy holds Python objects .*never unpickles"):
        datacat.open("prior", framework="torch", batch_size=4, catalog=catalog)
    _tables(tmp_path)
    np.save(tmp_path / "img_emb" / "img_emb_0002.npy", np.ones((17, DIM + 1), dtype=np.float16))
    with pytest.raises(
        datacat.ShardError, match=rf"img_emb_0002\.npy holds float16 \[17, {DIM + 1}\], the entry declares"
    ):
        datacat.open("prior", framework="torch", batch_size=4, catalog=catalog)
    assert json.loads(json.dumps(datacat.describe("prior", catalog=catalog)["declared"])) == {}


def test_datacat_count_prints_each_shards_rows(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from datacat.cli import main

    _tables(tmp_path)
    done = CliRunner().invoke(main, ["count", "prior"], env={"DATACAT_CATALOG": str(_catalog(tmp_path))})
    assert done.exit_code == 0, done.output
    assert "per_shard: {0000: 30, 0001: 25, 0002: 17}" in done.output and "samples: 72" in done.output


def test_datacat_load_reports_a_priors_batches(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from datacat.cli import main

    _tables(tmp_path)
    env = {"DATACAT_CATALOG": str(_catalog(tmp_path))}
    done = CliRunner().invoke(
        main, ["load", "prior", "--framework", "torch", "--workers", "0", "--grid", str(tmp_path / "g.png")], env=env
    )
    assert done.exit_code == 0, done.output
    assert "image_embedding" in done.output and "no contact sheet" in done.output
