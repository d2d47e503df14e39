"""`datacat embed` of an entry from a user's catalog writes a catalog that loads on its own (issue 36, defect 3)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from encoders import tiny
from helpers import make_tar, sample_members

import datacat
from datacat.cli import main


def _user_catalog(folder: Path) -> Path:
    """Two tar shards of 5 images under ``folder/shards`` and a catalog naming them by a relative root."""
    (folder / "shards").mkdir(parents=True)
    for shard in range(2):
        make_tar(folder / "shards" / f"{shard:04d}.tar", sample_members([f"{shard:04d}{row:04d}" for row in range(5)]))
    catalog = folder / "mine.yaml"
    catalog.write_text(
        "mytars:\n  description: a user's own tars\n  format: webdataset\n"
        "  location: {root: shards, shards: '{0000..0001}.tar'}\n"
        "  loading: {image_size: 16, val_batches: 0}\n"
    )
    return catalog


def test_the_catalog_embed_writes_for_a_user_entry_loads_on_its_own(tmp_path: Path) -> None:
    catalog = _user_catalog(tmp_path / "data")
    out = tmp_path / "emb"
    cwd = os.getcwd()
    os.chdir(tmp_path)  # elsewhere than the catalog: the written roots must not depend on where it ran
    try:
        ran = CliRunner().invoke(
            main,
            [
                "--catalog",
                str(catalog),
                "embed",
                "mytars",
                "--fn",
                "encoders:tiny",
                "--out",
                str(out),
                "--workers",
                "1",
            ],
        )
    finally:
        os.chdir(cwd)
    assert ran.exit_code == 0, ran.output

    loaded = CliRunner().invoke(
        main, ["--catalog", str(out / "catalog.yaml"), "load", "mytars-img-emb", "--framework", "torch"]
    )
    assert loaded.exit_code == 0, loaded.output

    written = datacat.load_catalog(out / "catalog.yaml")
    assert {"mytars", "mytars-img-emb", "mytars-prior"} <= set(written)
    assert os.path.isabs(written["mytars"].location.root)  # type: ignore[union-attr]
    loader = datacat.open(
        "mytars-img-emb", catalog=written, framework="torch", batch_size=10, shuffle=False, augmentation="none"
    )
    (batch,) = list(loader)
    assert sorted(batch["key"]) == [f"{s:04d}{r:04d}" for s in range(2) for r in range(5)]
    images = np.asarray(batch["image"])
    for row, embedding in zip(images, np.asarray(batch["embedding"]), strict=True):
        np.testing.assert_allclose(embedding, tiny(row[None], [""])["image"][0], rtol=1e-6)
