"""The contract every registered format keeps, in both frameworks: one suite over datacat's formats and a plugin's.

`vectors` is not datacat's: it comes from the test package in tests/plugin
(installed in the test venv, found through its ``datacat.formats`` entry
point; it touches no file under datacat/), with its own YAML section and a
non-image batch key. `pre_resized` is array_record's pre-resized layout as
`convert` writes it, read by the batch path (datacat.loading.filling), as
embedding tables are. For each case the suite writes 3 shards of 8
records and checks: validate, describe, count and verify; exactly once over
ranks x workers; exact resume; torch and jax agree; a bad record ledgered.
jax runs only in subprocesses (tests/harness.py), as in test_backends.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import jpeg, make_array_record, make_tar, sample_members
from test_backends import run_ranks

import datacat
from datacat.cli import main
from datacat.formats.packed import pack_record
from datacat.registry import format_of

SHARDS, PER_SHARD = 3, 8
RECORDS = SHARDS * PER_SHARD
DIM = 16  # 32-byte float16 rows: gathered as units by np.take, the path real tables take
ENTRY = "contract"


def _keys(shard: int) -> list[str]:
    return [f"{shard:04d}{row:04d}" for row in range(PER_SHARD)]


def _vectors(folder: Path, bad: str | None) -> tuple[str, str]:
    for shard in range(SHARDS):
        lines = []
        for i, key in enumerate(_keys(shard)):
            vector = [float(shard * PER_SHARD + i)] * (DIM - 1 if key == bad else DIM)
            lines.append(json.dumps({"key": key, "caption": f"caption of {key}", "vector": vector}))
        (folder / f"{shard:04d}.jsonl").write_text("\n".join(lines) + "\n")
    return "format: vectors", f"location: {{root: ., shards: '{{0000..0002}}.jsonl'}}\n  vectors: {{dim: {DIM}}}"


def _webdataset(folder: Path, bad: str | None) -> tuple[str, str]:
    for shard in range(SHARDS):
        make_tar(folder / f"{shard:04d}.tar", sample_members(_keys(shard), bad={bad} if bad else set()))
    return "format: webdataset", "location: {root: ., shards: '{0000..0002}.tar'}"


def _array_record(folder: Path, bad: str | None) -> tuple[str, str]:
    for shard in range(SHARDS):
        records = [
            pack_record({"jpg": b"not a jpeg" if key == bad else jpeg(i), "txt": f"caption of {key}", "key": key})
            for i, key in enumerate(_keys(shard))
        ]
        make_array_record(folder / f"{shard:04d}.array_record", records)
    return "format: array_record", "location: {root: ., shards: '{0000..0002}.array_record'}\n  record: {key: key}"


def _pre_resized(folder: Path, bad: str | None) -> tuple[str, str]:
    # As `datacat convert --layout pre_resized` writes them: uncompressed, one record a chunk (read by the batch path).
    from array_record.python import array_record_module

    for shard in range(SHARDS):
        writer = array_record_module.ArrayRecordWriter(
            str(folder / f"{shard:04d}.array_record"), "group_size:1,uncompressed"
        )
        for i, key in enumerate(_keys(shard)):
            pixels = np.random.default_rng(shard * PER_SHARD + i).integers(0, 256, (16, 16, 3), dtype=np.uint8)
            image = pixels.tobytes()[: 16 * 16 * 3 - (1 if key == bad else 0)]  # one short: a record that is bad
            shape = np.array([16, 16], "<i4").tobytes()
            writer.write(pack_record({"image": image, "shape": shape, "caption": f"caption of {key}", "key": key}))
        writer.close()
    return (
        "format: array_record",
        "location: {root: ., shards: '{0000..0002}.array_record'}\n  record: {layout: pre_resized, key: key}",
    )


def _embedding_table(folder: Path, bad: str | None) -> tuple[str, str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for sub in ("img_emb", "text_emb", "metadata"):
        (folder / sub).mkdir()
    for shard in range(SHARDS):
        image = np.stack([np.full(DIM, shard * PER_SHARD + i + 1, dtype=np.float16) for i in range(PER_SHARD)])
        if bad is not None and bad.startswith(f"{shard:04d}:"):
            image[int(bad.split(":")[1])] = 0  # an all-zero row: one the embedding job could not compute
        np.save(folder / "img_emb" / f"img_emb_{shard:04d}.npy", image)
        np.save(folder / "text_emb" / f"text_emb_{shard:04d}.npy", -image)
        captions = pa.table({"caption": [f"row {shard}:{i}" for i in range(PER_SHARD)]})
        pq.write_table(captions, folder / "metadata" / f"metadata_{shard:04d}.parquet")
    return "format: embedding_table", f"location: {{root: ., shards: '{{0000..0002}}'}}\n  prior: {{dim: {DIM}}}"


BUILDERS: dict[str, tuple[Callable[[Path, str | None], tuple[str, str]], str]] = {
    "vectors": (_vectors, "00010003"),
    "webdataset": (_webdataset, "00010003"),
    "array_record": (_array_record, "00010003"),
    "pre_resized": (_pre_resized, "00010003"),
    "embedding_table": (_embedding_table, "0001:3"),
}
"""Each case's data writer and the key its bad variant spoils: every format, and the pre-resized layout."""
FORMATS = list(BUILDERS)
FORMAT_OF = {name: "array_record" if name == "pre_resized" else name for name in FORMATS}
"""Each case's format."""


def _dataset(folder: Path, name: str, *, bad: bool = False) -> Path:
    """Writes format ``name``'s shards (one record spoilt with ``bad``) and a catalog naming them ``contract``."""
    folder.mkdir(parents=True)
    build, spoilt = BUILDERS[name]
    format_line, rest = build(folder, spoilt if bad else None)
    catalog = folder / "c.yaml"
    catalog.write_text(
        f"{ENTRY}:\n  description: the contract suite's {name}\n  {format_line}\n  {rest}\n"
        "  loading: {image_size: 16, val_batches: 0, augmentation: flip_only}\n"
    )
    return catalog


@pytest.fixture(scope="module")
def catalogs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each format's catalog file: ``NAME`` intact, ``NAME-bad`` with one bad record."""
    root = tmp_path_factory.mktemp("contract")
    out = {name: _dataset(root / name, name) for name in FORMATS}
    out |= {f"{name}-bad": _dataset(root / f"{name}-bad", name, bad=True) for name in FORMATS}
    return out


def _cli(catalog: Path, *args: str) -> Any:
    return CliRunner().invoke(main, ["--catalog", str(catalog), *args])


def test_the_plugin_format_comes_from_its_installed_package_entry_point() -> None:
    import importlib.metadata

    (point,) = [p for p in importlib.metadata.entry_points(group="datacat.formats") if p.name == "vectors"]
    assert point.value == "datacat_vectors:FORMAT" and point.dist is not None
    assert point.dist.name == "datacat-vectors"
    declared = format_of("vectors")
    module = sys.modules["datacat_vectors"]
    assert declared is module.FORMAT and "site-packages" in str(module.__file__)
    assert declared.section == "vectors" and declared.arrays == ("vector",)


@pytest.mark.parametrize("name", FORMATS)
def test_validate_describe_count_and_verify(catalogs: dict[str, Path], name: str) -> None:
    catalog = catalogs[name]
    assert _cli(catalog, "validate").exit_code == 0
    described = _cli(catalog, "describe", ENTRY)
    assert described.exit_code == 0, described.output
    for line in format_of(FORMAT_OF[name]).contract(datacat.resolve(ENTRY, catalog=datacat.load_catalog(catalog))):
        assert line[:30] in " ".join(described.output.split())  # the format's own rules, printed
    counted = _cli(catalog, "count", ENTRY)
    assert counted.exit_code == 0, counted.output
    assert counted.output.count(f": {PER_SHARD}") == SHARDS
    verified = _cli(catalog, "verify", ENTRY)
    if format_of(FORMAT_OF[name]).shard_facts is None:  # verify says which formats it checks
        assert verified.exit_code == 1 and "verify checks entries of" in verified.output
        assert "vectors" in verified.output
    else:
        assert verified.exit_code == 0, verified.output
        assert f"{SHARDS} shard(s) found" in verified.output and f"{RECORDS} records" in verified.output


@pytest.mark.parametrize("name", [n for n in FORMATS if format_of(FORMAT_OF[n]).section is not None])
def test_a_wrong_key_in_the_formats_own_section_names_the_file_line_and_key(tmp_path: Path, name: str) -> None:
    catalog = _dataset(tmp_path / name, name)
    section = format_of(FORMAT_OF[name]).section
    text = catalog.read_text().replace(f"{section}: {{dim:", f"{section}: {{dimm: 3, dim:")
    catalog.write_text(text)
    with pytest.raises(datacat.CatalogError) as raised:
        datacat.load_catalog(catalog)
    (problem,) = raised.value.problems
    assert problem.line == 5 and problem.path == f"{ENTRY}.{section}.dimm", problem
    assert f"unknown key of {section}" in problem.message


def _loads(catalogs: dict[str, Path], key: str, **options: Any) -> list[dict[str, Any]]:
    return [{"name": ENTRY, "catalog_file": str(catalogs[f"{name}{key}"]), **options} for name in FORMATS]


@pytest.mark.slow
@pytest.mark.parametrize(("framework", "workers"), [("torch", 2), ("jax", 1)])
def test_exactly_once_over_ranks_and_workers_and_a_bad_record_ledgered(
    catalogs: dict[str, Path], framework: str, workers: int
) -> None:
    base = {"batch_size": 4, "world_size": 2, "num_workers": workers, "seed": 3}
    intact = _loads(catalogs, "", **base)
    spoilt = _loads(catalogs, "-bad", **base, on_bad_sample="skip", bad_sample_budget=0.5)
    per_rank = [[{**load, "rank": rank} for load in intact + spoilt] for rank in range(2)]
    results = run_ranks(framework, per_rank)
    for i, name in enumerate(FORMATS):
        keys = [k for rank in results for batch in rank[i]["batches"] for k in batch]
        assert len(keys) == len(set(keys)) == RECORDS, (framework, name)
        assert len({len(rank[i]["batches"]) for rank in results}) == 1  # every rank the same batches
        kept = [k for rank in results for batch in rank[len(FORMATS) + i]["batches"] for k in batch]
        assert len(kept) == len(set(kept)) == RECORDS - 1 and BUILDERS[name][1] not in kept, (framework, name)


@pytest.mark.slow
def test_exact_resume_and_torch_and_jax_agreement(catalogs: dict[str, Path]) -> None:
    # Each format resumed once (a loader with a worker each: jax spawns them), inside the first epoch or the
    # second by turns, so both kinds of resume point meet every framework.
    base = {"batch_size": 4, "epochs": 2, "seed": 7, "num_workers": 1}
    points = [[3] if i % 2 else [8] for i in range(len(FORMATS))]
    runs = {}
    for framework in ("torch", "jax"):
        loads = [{**load, "states_at": at} for load, at in zip(_loads(catalogs, "", **base), points, strict=True)]
        (full,) = run_ranks(framework, [loads])
        states = [(i, state) for i, run in enumerate(full) for state in run["states"]]
        resumed = run_ranks(framework, [[{**_loads(catalogs, "", **base)[i], "state": s} for i, s in states]])[0]
        for (i, _), (k,), rest in zip(states, points, resumed, strict=True):
            assert full[i]["batches"][:k] + rest["batches"] == full[i]["batches"], (framework, FORMATS[i], k)
            assert {key: full[i]["pixels"][key] for key in rest["pixels"]} == rest["pixels"]
        runs[framework] = full
    for i, name in enumerate(FORMATS):  # one Plan and seed: the same batches, the same arrays
        assert runs["torch"][i]["batches"] == runs["jax"][i]["batches"], name
        assert runs["torch"][i]["pixels"] == runs["jax"][i]["pixels"], name


@pytest.mark.parametrize("name", FORMATS)
def test_a_bad_record_under_raise_names_its_key(catalogs: dict[str, Path], name: str) -> None:
    catalog = datacat.load_catalog(catalogs[f"{name}-bad"])
    loader = datacat.open(ENTRY, catalog=catalog, framework="torch", batch_size=4, on_bad_sample="raise")
    with pytest.raises(datacat.DatacatError) as raised:
        list(loader)
    message = str(raised.value)  # the shard, and the record by its key (or its place, when its key is unreadable)
    assert f"{name}-bad/" in message and "0001" in message, message
    assert BUILDERS[name][1] in message or ":3" in message, message
    skipping = datacat.open(
        ENTRY, catalog=catalog, framework="torch", batch_size=4, on_bad_sample="skip", bad_sample_budget=0.5
    )
    kept = [k for batch in skipping for k in batch["key"]]
    assert len(kept) == RECORDS - 1 and BUILDERS[name][1] not in kept
    (skipped,) = skipping.ledger.skipped
    assert f"{name}-bad/" in skipped.shard and "0001" in skipped.shard, skipped
