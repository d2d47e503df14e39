"""Elastic resume: an epoch stopped on 8 ranks continues on 4, or on 16 with another batch size, each record once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import jpeg, make_array_record, make_tar, sample_members
from test_backends import run_ranks

import datacat
from datacat.errors import PlanMismatch
from datacat.formats.packed import pack_record

WORLD, BATCH = 8, 2  # the run that stops
STOPPED = 1  # after this many steps (each rank its first batch)
ELSEWHERE = [(4, 2), (16, 3)]  # where it resumes: world size, per-rank batch


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Indexed tars (48 records), ArrayRecords (40) and another ArrayRecord set (30), and a mixture of the three."""
    root = tmp_path_factory.mktemp("elastic")
    (root / "tars").mkdir()
    for shard in range(3):
        make_tar(root / "tars" / f"{shard}.tar", sample_members([f"t{shard}{i:03d}" for i in range(16)]))
    for name, shards, per in (("ar", 4, 10), ("ar2", 3, 10)):
        (root / name).mkdir()
        for shard in range(shards):
            keys = [f"{name}{shard}{i:03d}" for i in range(per)]
            records = [pack_record({"jpg": jpeg(i), "txt": f"caption of {k}", "key": k}) for i, k in enumerate(keys)]
            make_array_record(root / name / f"{shard}.array_record", records)
    loading = "  loading: {image_size: 16, val_batches: 0, augmentation: flip_only}\n"
    path = root / "c.yaml"
    path.write_text(
        "tars:\n  description: d\n  format: webdataset\n  location: {root: tars, shards: '{0..2}.tar'}\n" + loading
        + "ar:\n  description: d\n  format: array_record\n  location: {root: ar, shards: '{0..3}.array_record'}\n"
        "  record: {key: key}\n" + loading
        + "ar2:\n  description: d\n  format: array_record\n  location: {root: ar2, shards: '{0..2}.array_record'}\n"
        "  record: {key: key}\n" + loading
        + "mix:\n  description: d\n  format: mixture\n" + loading
        + "  mixture:\n    exhaustion: stop_on_all\n    components:\n"
        "      - {name: tars, weight: 2}\n      - {name: ar, weight: 1}\n      - {name: ar2, weight: 1}\n"
    )  # fmt: skip
    return path


NAMES = ["tars", "ar", "mix"]
RECORDS = {"tars": 48, "ar": 40, "mix": 118}


def _load(catalog: Path, name: str, **options: Any) -> dict[str, Any]:
    return {"name": name, "catalog_file": str(catalog), "seed": 11, "epochs": 1, "num_workers": 0, **options}


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_an_epoch_stopped_on_8_ranks_resumes_on_4_and_on_16_with_each_record_once(
    catalog: Path, framework: str
) -> None:
    # Phase 1, one process: a single process with batch 8 x 2, and the 8 ranks, each stopped after its first batch.
    loads = [_load(catalog, name, batch_size=WORLD * BATCH) for name in NAMES]
    loads += [
        _load(catalog, name, batch_size=BATCH, rank=r, world_size=WORLD, stop_after=STOPPED)
        for name in NAMES
        for r in range(WORLD)
    ]
    (first,) = run_ranks(framework, [loads])
    single, stopped = first[: len(NAMES)], first[len(NAMES) :]
    # Phase 2: the saved states continued on other world sizes and batch sizes (torch: with workers).
    workers = 2 if framework == "torch" else 0
    resumed_loads = []
    for i, name in enumerate(NAMES):
        for world, batch in ELSEWHERE:
            for r in range(world):
                state = stopped[i * WORLD + r % WORLD]["state"]  # any rank's: all stopped at one global position
                resumed_loads.append(
                    _load(catalog, name, batch_size=batch, rank=r, world_size=world, state=state, num_workers=workers)
                )
    (second,) = run_ranks(framework, [resumed_loads])
    at = 0
    for i, name in enumerate(NAMES):
        ranks = stopped[i * WORLD : (i + 1) * WORLD]
        # The 8 ranks' first step, rank after rank, is the single process's first batch.
        assert [k for rank in ranks for k in rank["batches"][0]] == single[i]["batches"][0], name
        before = [k for rank in ranks for batch in rank["batches"] for k in batch]
        everything = [k for batch in single[i]["batches"] for k in batch]
        assert len(everything) == len(set(everything)) == RECORDS[name]
        for world, batch in ELSEWHERE:
            rest = [k for rank in second[at : at + world] for b in rank["batches"] for k in b]
            counts = {len(rank["batches"]) for rank in second[at : at + world]}
            at += world
            assert len(counts) == 1, (name, world)  # every rank the same number of batches
            assert sorted(before + rest) == sorted(everything), (name, world, batch)  # each record once
            steps = [[k for rank in second[at - world : at] for k in rank["batches"][b]] for b in range(counts.pop())]
            assert [k for step in steps for k in step] == everything[len(before) :], (name, world)  # the global order


def test_a_stream_format_refuses_another_world_and_says_what_to_do(tmp_path: Path) -> None:
    make_tar(tmp_path / "0.tar", sample_members([f"k{i}" for i in range(12)]), compress=True)
    (tmp_path / "c.yaml").write_text(
        "gz:\n  description: d\n  format: webdataset\n  location: {root: ., shards: [0.tar]}\n"
        "  totals: {per_shard: {0.tar: 12}}\n  loading: {image_size: 16, val_batches: 0}\n"
    )
    catalog = datacat.load_catalog(tmp_path / "c.yaml")
    loader = datacat.open("gz", catalog=catalog, framework="torch", batch_size=2, rank=0, world_size=2)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    other = datacat.open("gz", catalog=catalog, framework="torch", batch_size=2, rank=0, world_size=3)
    with pytest.raises(PlanMismatch, match="read front to back per rank: resume on the saved world size"):
        other.load_state_dict(state)


MULTIHOST = Path(__file__).parent / "jax_multihost.py"


def _jax_job(catalog: Path, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs one jax process a job under jax.distributed on 127.0.0.1, all at once; each one's result."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    common = {"port": port, "processes": len(jobs), "catalog": str(catalog)}
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, str(MULTIHOST)]
    procs = [
        subprocess.Popen(
            [*command, json.dumps({**common, "process": p, **job})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for p, job in enumerate(jobs)
    ]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[len("RESULT ") :]))
    finally:
        for proc in procs:  # a process left waiting for its peers is not left behind
            proc.kill()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 4])
def test_jax_distributed_batches_are_global_arrays_of_each_processs_own_records(catalog: Path, processes: int) -> None:
    job = {"name": "ar", "options": {"batch_size": 4, "seed": 3, "epochs": 1, "drop_remainder": True}}
    full = _jax_job(catalog, [job] * processes)
    assert [r["rank"] for r in full] == list(range(processes)) and {r["world"] for r in full} == {processes}
    steps = len(full[0]["batches"])
    assert steps == 40 // (4 * processes) and all(len(r["batches"]) == steps for r in full)
    for r in full:
        for batch in r["batches"]:
            assert batch["shape"] == [4 * processes, 16, 16, 3] and not batch["fully_addressable"]
            assert batch["own_rows"] and batch["first_row"] == 4 * r["rank"]  # rank r's rows, r-th in the step
    keys = [k for r in full for b in r["batches"] for k in b["keys"]]
    assert len(keys) == len(set(keys)) == steps * 4 * processes  # every record once (the tail fills no step)
    if processes == 2:  # both processes stopped after 2 steps and started again from their states: exact
        stopped = _jax_job(catalog, [{**job, "stop_after": 2}] * 2)
        resumed = _jax_job(catalog, [{**job, "state": r["state"]} for r in stopped])
        for r, s, again in zip(full, stopped, resumed, strict=True):
            assert [b["keys"] for b in s["batches"] + again["batches"]] == [b["keys"] for b in r["batches"]]
