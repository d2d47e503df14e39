"""Beam jobs on the DirectRunner: convert, embed and verify --deep, over real shards (no network)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from encoders import tiny
from helpers import jpeg, make_tar, read_all, sample_members

import datacat
from datacat.beam import pipeline_options
from datacat.beam.convert import convert
from datacat.beam.embed import embed
from datacat.cli import main
from datacat.formats.ar_pixels import PreResizedFill
from datacat.loading.sources import SampleSource

ONE = pipeline_options(workers=1)  # in this process: pytest's monkeypatches reach the job


def _pixels(name: str, catalog: datacat.Catalog | None = None, **options: Any) -> dict[str, np.ndarray]:
    """Key -> image of every sample, as the loader gives them without augmentation."""
    plan = datacat.resolve(name, catalog=catalog, augmentation="none", val_batches=0, **options)
    return {s["key"]: s["image"] for s in read_all(SampleSource(plan))}


def _batches(name: str, framework: str, catalog: datacat.Catalog) -> dict[str, np.ndarray]:
    loader = datacat.open(name, framework=framework, batch_size=8, catalog=catalog, augmentation="none", shuffle=False)
    out = {}
    for batch in loader:
        for key, image in zip(batch["key"], np.asarray(batch["image"]), strict=True):
            out[key] = image
    return out


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_convert_tars_keeps_keys_and_pixels_in_both_frameworks(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["convert", "sample", "--out", str(tmp_path / "out"), "--records-per-shard", "20", "--workers", "1"]
    )
    assert result.exit_code == 0, result.output
    assert "records written │    55" in result.output
    assert f"load it: datacat --catalog {tmp_path / 'out' / 'catalog.yaml'} load sample-converted" in result.output
    names = sorted(p.name for p in (tmp_path / "out").glob("*.array_record"))
    assert names == [f"data-{k:05d}-of-00003.array_record" for k in range(3)]
    assert not (tmp_path / "out" / ".datacat-tmp").exists()

    catalog = datacat.load_catalog([tmp_path / "out" / "catalog.yaml"])
    plan = datacat.resolve("sample-converted", catalog=catalog)
    assert [s.samples for s in plan.shards] == [20, 20, 15] and plan.samples_exact
    source = _pixels("sample")
    for framework in ("torch", "jax"):
        loaded = _batches("sample-converted", framework, catalog)
        assert list(loaded) == list(source)  # the same keys, in the source's order
        assert all(np.array_equal(loaded[k], source[k]) for k in source)
    captions = {
        s["key"]: s["caption"] for s in read_all(SampleSource(datacat.resolve("sample-converted", catalog=catalog)))
    }
    assert captions["00000000"].startswith("a NASA portrait of astronaut Eileen Collins")


def test_convert_image_folder_pre_resized_gives_the_transform_s_pixels(tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    (folder / "sub").mkdir(parents=True)
    for i in range(7):
        (folder / ("sub" if i % 2 else "") / f"p{i}.jpg").write_bytes(jpeg(i, (60 + 7 * i, 44)))
        (folder / ("sub" if i % 2 else "") / f"p{i}.txt").write_text(f"photo {i}")
    (tmp_path / "c.yaml").write_text(
        "photos:\n  description: d\n  format: image_folder\n  location: {root: ., shards: [photos]}\n"
        "  loading: {image_size: 24, val_batches: 0}\n"
    )
    catalog = datacat.load_catalog([tmp_path / "c.yaml"])
    written, counters = convert(
        "photos", str(tmp_path / "out"), catalog=catalog, layout="pre_resized", records_per_shard=3, options=ONE
    )
    assert counters == {"records_read": 7, "records_written": 7, "records_bad": 0}
    converted = datacat.load_catalog([tmp_path / "c.yaml", written])
    plan = datacat.resolve("photos-converted", catalog=converted)
    assert plan.record.layout == "pre_resized"
    fill = SampleSource(plan).fill  # uncompressed, one record a chunk: each shard read straight into batches
    assert isinstance(fill, PreResizedFill) and all(fill._shard(i) is not None for i in range(len(plan.shards)))
    source = _pixels("photos", catalog)
    for framework in ("torch", "jax"):
        loaded = _batches("photos-converted", framework, converted)
        assert list(loaded) == list(source) and all(np.array_equal(loaded[k], source[k]) for k in source)


@pytest.mark.slow
def test_convert_is_byte_identical_with_one_or_four_workers(tmp_path: Path) -> None:
    convert("sample", str(tmp_path / "one"), records_per_shard=7, options=pipeline_options(workers=1))
    convert("sample", str(tmp_path / "four"), records_per_shard=7, options=pipeline_options(workers=4))
    one, four = _digests(tmp_path / "one"), _digests(tmp_path / "four")
    assert len([n for n in one if n.endswith(".array_record")]) == 8
    assert one == four


KILLED_MID_WAY = """
import os, signal, sys
from datacat.beam import pipeline_options
from datacat.beam.convert import convert

rename = os.replace


def replace(src, dst):
    if "data-00002-" in str(dst):  # shard 2 is written under its temporary name, not yet renamed into place
        os.kill(os.getpid(), signal.SIGKILL)
    rename(src, dst)


os.replace = replace
convert("sample", sys.argv[1], records_per_shard=7, options=pipeline_options(workers=1))
"""


@pytest.mark.slow
def test_a_convert_killed_mid_way_leaves_no_shard_that_is_read(tmp_path: Path) -> None:
    import subprocess
    import sys

    from datacat.formats.ar_shards import count_records

    out, clean = tmp_path / "out", tmp_path / "clean"
    killed = subprocess.run([sys.executable, "-c", KILLED_MID_WAY, str(out)], capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not (out / "catalog.yaml").exists()  # no entry: nothing names these files yet
    assert list((out / ".datacat-tmp").iterdir())  # shard 2, left under its temporary name
    convert("sample", str(clean), records_per_shard=7, options=ONE)
    finals = sorted(out.glob("*.array_record"))
    assert "data-00002-of-00008.array_record" not in {p.name for p in finals}
    for shard in finals:  # any shard under its final name is whole: the clean run's bytes
        assert shard.read_bytes() == (clean / shard.name).read_bytes() and count_records(str(shard)) == 7

    convert("sample", str(out), records_per_shard=7, options=ONE)  # the rerun
    assert _digests(out) == _digests(clean)
    assert not (out / ".datacat-tmp").exists()
    catalog = datacat.load_catalog([out / "catalog.yaml"])
    assert len(read_all(SampleSource(datacat.resolve("sample-converted", catalog=catalog)))) == 55


def test_embed_rows_are_fn_of_the_image_of_their_key(tmp_path: Path) -> None:
    written, counters = embed("sample", str(tmp_path / "emb"), "encoders:tiny", batch_size=8, options=ONE)
    assert counters == {"records_read": 55, "records_embedded": 55}
    assert sorted(p.name for p in (tmp_path / "emb" / "img_emb").iterdir()) == [
        "img_emb_0000.npy",
        "img_emb_0001.npy",
        "img_emb_0003.npy",
    ]
    catalog = datacat.load_catalog([written])
    images = _pixels("sample")
    joined = read_all(SampleSource(datacat.resolve("sample-img-emb", catalog=catalog)))
    assert len(joined) == 55
    for sample in joined:
        expected = tiny(images[sample["key"]][None], [""])["image"][0]
        np.testing.assert_allclose(sample["embedding"], expected, rtol=1e-6)
    prior = read_all(SampleSource(datacat.resolve("sample-prior", catalog=catalog)))
    assert len(prior) == 55 and prior[0]["text_embedding"].shape == (48,)
    assert prior[0]["caption"].startswith("a NASA portrait")


def _tars_with_a_corrupt_image(folder: Path) -> datacat.Catalog:
    folder.mkdir()
    for shard in range(2):
        keys = [f"{shard:04d}{row:04d}" for row in range(6)]
        make_tar(folder / f"{shard:04d}.tar", sample_members(keys, bad={"00010003"}))
    (folder / "c.yaml").write_text(
        "tars:\n  description: d\n  format: webdataset\n  location: {root: ., shards: '{0000..0001}.tar'}\n"
        "  loading: {image_size: 16, val_batches: 0, on_bad_sample: skip}\n"
    )
    return datacat.load_catalog([folder / "c.yaml"])


def test_embed_gives_a_corrupt_image_a_zero_row_and_a_ledger_line(tmp_path: Path) -> None:
    catalog = _tars_with_a_corrupt_image(tmp_path / "tars")
    _, counters = embed("tars", str(tmp_path / "emb"), "encoders:tiny", catalog=catalog, batch_size=4, options=ONE)
    assert counters["records_bad"] == 1 and counters["records_embedded"] == 11
    rows = np.load(tmp_path / "emb" / "img_emb" / "img_emb_0001.npy")
    assert rows.shape == (6, 48) and not rows[3].any() and all(rows[i].any() for i in (0, 1, 2, 4, 5))
    (line,) = (tmp_path / "emb" / "ledger.jsonl").read_text().splitlines()
    assert (
        json.loads(line)["key"] == "00010003" and json.loads(line)["row"] == 3 and json.loads(line)["shard"] == "0001"
    )


def test_verify_deep_as_a_beam_job_matches_the_single_machine_verify(tmp_path: Path) -> None:
    from datacat.storage.manifests import load_manifest
    from datacat.verify import verify

    catalog = _tars_with_a_corrupt_image(tmp_path / "tars")
    alone = verify("tars", catalog=catalog, deep=True)
    first = load_manifest(datacat.resolve("tars", catalog=catalog).manifest)
    Path(alone.manifest or "").unlink()
    from datacat.beam.verify import bad_records_job

    on_beam = verify("tars", catalog=catalog, deep=True, deep_check=lambda plan: bad_records_job(plan, ONE))
    assert [(b.key, b.reason) for b in on_beam.bad_samples] == [(b.key, b.reason) for b in alone.bad_samples]
    assert [b.key for b in on_beam.bad_samples] == ["00010003"]
    assert on_beam.problems == alone.problems and not on_beam.ok
    again = load_manifest(datacat.resolve("tars", catalog=catalog).manifest)
    assert first is not None and again is not None and again.to_json() == first.to_json()


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--runner=DataflowRunner",
            "--project=my-project",
            "--region=us-central1",
            "--temp_location=gs://my-bucket/tmp",
            "--dry_run=true",
        ],
        ["--runner=FlinkRunner", "--flink_master=localhost:8081", "--environment_type=LOOPBACK"],
        ["--runner=SparkRunner", "--spark_master_url=spark://localhost:7077"],
    ],
)
def test_jobs_build_unchanged_for_other_runners(flags: list[str]) -> None:
    import apache_beam as beam
    from apache_beam.options.pipeline_options import StandardOptions

    from datacat.beam import convert as convert_job
    from datacat.beam import embed as embed_job

    options = pipeline_options(flags, workers=4)
    assert options.view_as(StandardOptions).runner == flags[0].split("=")[1]
    plan = datacat.resolve("sample", augmentation="none", val_batches=0)
    for build, job in (
        (convert_job.build, convert_job.Conversion(plan, "gs://my-bucket/out", records=55)),
        (
            embed_job.build,
            embed_job.Embedding(plan, "gs://my-bucket/emb", "encoders:tiny", 8, ("0000",), (0, 19), 48, 48),
        ),
    ):
        pipeline = beam.Pipeline(options=options)
        build(pipeline, job)
        proto = pipeline.to_runner_api()  # every step serialised, as a runner receives it
        labels = {t.unique_name for t in proto.components.transforms.values()}
        assert {"shards", "spread", "finish"} <= labels


def test_convert_a_mixture_writes_its_epoch_in_order_with_each_record_s_component(tmp_path: Path) -> None:
    from datacat.beam.convert import _open_view
    from datacat.formats.array_record import ArrayRecordReader
    from datacat.formats.packed import unpack_record

    (tmp_path / "mix.yaml").write_text(
        "mix:\n  description: d\n  format: mixture\n  mixture:\n    components:\n"
        "      - {name: sample, weight: 2}\n      - {name: sample-arrayrecord, weight: 1}\n"
    )
    catalog = datacat.load_catalog([tmp_path / "mix.yaml"])
    written, counters = convert("mix", str(tmp_path / "out"), catalog=catalog, records_per_shard=40, options=ONE)
    assert counters["records_written"] == 110
    view = _open_view(datacat.resolve("mix", catalog=catalog, val_batches=0, augmentation="none"))
    expected = [(s["component"], s["key"]) for s in view.finish(view.fetch(range(110)))]
    reader = ArrayRecordReader(datacat.resolve("mix-converted", catalog=datacat.load_catalog([written])))
    entries = [unpack_record(item.payload) for item in reader.items(range(110))]  # type: ignore[union-attr]
    assert [(e["component"].decode(), e["key"].decode()) for e in entries] == expected
    assert {c for c, _ in expected} == {"sample", "sample-arrayrecord"}


@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_shard_gone_during_the_job_fails_it_with_the_error_naming_the_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    """In this process or in a worker process (Beam hands back its text), the same error class comes out."""
    import datacat.beam.convert as job

    catalog = _tars_with_a_corrupt_image(tmp_path / "tars")
    survey = job._survey

    def survey_then_lose_a_shard(plan: Any) -> Any:
        found = survey(plan)
        (tmp_path / "tars" / "0001.tar").unlink()  # after the job was planned, before it reads
        return found

    monkeypatch.setattr(job, "_survey", survey_then_lose_a_shard)
    with pytest.raises(FileNotFoundError, match=r"0001\.tar"):
        options = pipeline_options(workers=workers)
        convert("tars", str(tmp_path / "out"), catalog=catalog, records_per_shard=4, options=options)
    assert not (tmp_path / "out" / "catalog.yaml").exists()
