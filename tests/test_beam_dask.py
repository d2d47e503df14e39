"""Beam jobs on Beam's DaskRunner against a dask.distributed cluster of separate processes (issue 36).

The cluster (tests/dask_cluster.py) is what a user starts on their hosts:
``dask scheduler`` and two ``dask worker`` processes on 127.0.0.1. Every
job must give the DirectRunner's bytes; a worker killed mid-job must
leave no half-written file under a final name; a user function's error
must come back as one line naming the function and the record.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from dask_cluster import DaskCluster, dask_cluster_fixture  # noqa: F401 (the fixture)
from helpers import make_tar, sample_members

import datacat
from datacat.beam import pipeline_options
from datacat.beam.convert import convert
from datacat.beam.embed import embed
from datacat.beam.verify import bad_records_job
from datacat.cli import main
from datacat.verify import verify

pytestmark = pytest.mark.slow
DIRECT = pipeline_options(workers=1)


def _on(cluster: DaskCluster) -> list[str]:
    return ["--runner", "DaskRunner", "--dask_client_address", cluster.address]


def _digests(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (sub-folders too) by relative path, and its sha256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _tars(folder: Path, *, bad: set[str] = frozenset()) -> datacat.Catalog:  # type: ignore[assignment]
    folder.mkdir(parents=True)
    for shard in range(3):
        keys = [f"{shard:04d}{row:04d}" for row in range(6)]
        make_tar(folder / f"{shard:04d}.tar", sample_members(keys, bad=bad))
    (folder / "c.yaml").write_text(
        "tars:\n  description: d\n  format: webdataset\n  location: {root: ., shards: '{0000..0002}.tar'}\n"
        "  loading: {image_size: 16, val_batches: 0, on_bad_sample: skip}\n"
    )
    return datacat.load_catalog([folder / "c.yaml"])


def test_the_cluster_runs_tasks_in_two_other_processes(dask_cluster: DaskCluster) -> None:
    pids = dask_cluster.worker_pids()
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_convert_embed_and_deep_verify_on_dask_give_the_direct_runners_bytes(
    dask_cluster: DaskCluster, tmp_path: Path
) -> None:
    on_dask = pipeline_options(_on(dask_cluster))
    catalog = _tars(tmp_path / "tars", bad={"00010003"})

    _, direct = convert("tars", str(tmp_path / "ar-direct"), catalog=catalog, records_per_shard=5, options=DIRECT)
    _, dask = convert("tars", str(tmp_path / "ar-dask"), catalog=catalog, records_per_shard=5, options=on_dask)
    assert _digests(tmp_path / "ar-dask") == _digests(tmp_path / "ar-direct")
    assert dask == direct == {"records_read": 18, "records_written": 17, "records_bad": 1}

    _, direct = embed("tars", str(tmp_path / "emb-direct"), "encoders:tiny", catalog=catalog, options=DIRECT)
    _, dask = embed("tars", str(tmp_path / "emb-dask"), "encoders:tiny", catalog=catalog, options=on_dask)
    assert _digests(tmp_path / "emb-dask") == _digests(tmp_path / "emb-direct")
    assert dask == direct == {"records_read": 18, "records_embedded": 17, "records_bad": 1}

    alone = verify("tars", catalog=catalog, deep=True, deep_check=lambda plan: bad_records_job(plan, DIRECT))
    spread = verify("tars", catalog=catalog, deep=True, deep_check=lambda plan: bad_records_job(plan, on_dask))
    assert spread.to_json() == alone.to_json() and not spread.ok
    assert [b.key for b in spread.bad_samples] == ["00010003"]


def test_a_worker_killed_mid_job_leaves_no_half_file_and_the_job_completes(
    dask_cluster: DaskCluster, tmp_path: Path
) -> None:
    catalog = _tars(tmp_path / "tars")
    # Here (no DATACAT_TEST_KILL_MARKER in this process) the function kills nothing: the clean bytes.
    embed("tars", str(tmp_path / "clean"), "encoders:kills_its_worker_once", catalog=catalog, options=DIRECT)
    out = tmp_path / "killed"
    try:
        embed(
            "tars",
            str(out),
            "encoders:kills_its_worker_once",
            catalog=catalog,
            options=pipeline_options(_on(dask_cluster)),
        )
    except datacat.DatacatError:
        embed(  # the rerun
            "tars",
            str(out),
            "encoders:kills_its_worker_once",
            catalog=catalog,
            options=pipeline_options(_on(dask_cluster)),
        )
    assert dask_cluster.kill_marker.exists()  # a worker process died by SIGKILL inside the job
    killed = int(dask_cluster.kill_marker.read_text())
    dask_cluster.wait_for_workers()  # its nanny starts it again
    assert killed not in dask_cluster.worker_pids()
    assert _digests(out) == _digests(tmp_path / "clean")  # every file whole, none left under a temporary name


def test_an_error_in_the_users_fn_is_one_line_naming_the_function_and_the_record(
    dask_cluster: DaskCluster, tmp_path: Path
) -> None:
    _tars(tmp_path / "tars")
    ran = CliRunner().invoke(
        main,
        [
            "--catalog",
            str(tmp_path / "tars" / "c.yaml"),
            "embed",
            "tars",
            "--fn",
            "encoders:fails_on_key_00010002",
            "--out",
            str(tmp_path / "emb"),
            *_on(dask_cluster),
        ],
    )
    assert ran.exit_code == 1, ran.output
    (line,) = [line for line in ran.output.splitlines() if line.startswith("error: ")]
    assert line == (
        "error: --fn encoders:fails_on_key_00010002 failed on record 00010002 of shard 0001: "
        "ValueError: this encoder cannot take that image"
    ), ran.output
    assert "Traceback" not in ran.output
    assert not (tmp_path / "emb" / "catalog.yaml").exists()
