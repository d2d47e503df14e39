"""Shards on gs:// through real gcsfs (tars) and array_record's C++ client, against a local GCS emulator."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import read_all, sample_at

import datacat
from datacat.catalog import builtin_catalog_dir
from datacat.loading.sources import SampleSource

pytestmark = pytest.mark.slow  # every test here starts processes or a storage server


@pytest.fixture
def bucket(gcs_emulator: str) -> str:
    gcsfs = pytest.importorskip("gcsfs", reason="needs gcsfs (the [gcs] extra)")
    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=gcs_emulator)
    if not fs.exists("datacat-test"):
        fs.mkdir("datacat-test")
    sample = builtin_catalog_dir() / "sample"
    for sub in ("webdataset", "array_record"):
        for path in sorted((sample / sub).iterdir()):
            fs.pipe(f"datacat-test/{sub}/{path.name}", path.read_bytes())
    fs.invalidate_cache()
    return "gs://datacat-test"


def _catalog(tmp_path: Path) -> datacat.Catalog:
    (tmp_path / "gcs.yaml").write_text(
        "gwds:\n  description: d\n  format: webdataset\n"
        "  location: {root: '${TEST_BUCKET}', path: webdataset, shards: '{0000..0003}.tar', missing: [2], storage_options: {token: anon}}\n"
        "  totals: {per_shard: {0000.tar: 19, 0001.tar: 19, 0003.tar: 17}}\n"
        "gar:\n  description: d\n  format: array_record\n"
        "  location: {root: '${TEST_BUCKET}', path: array_record, shards: '*.array_record', storage_options: {token: anon}}\n"
        "  record: {layout: packed, key: key}\n"
    )
    return datacat.load_catalog([tmp_path / "gcs.yaml"], builtin=False, env={"TEST_BUCKET": "x"})


def test_tars_and_array_records_read_from_gs(bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_BUCKET", bucket)
    catalog = _catalog(tmp_path)
    local = [s["key"] for s in read_all(SampleSource(datacat.resolve("sample", image_size=16)))]

    wds = datacat.resolve("gwds", catalog=catalog, image_size=16)
    assert wds.shards[0].url == "gs://datacat-test/webdataset/0000.tar"
    assert [s["key"] for s in read_all(SampleSource(wds))] == local

    ar = datacat.resolve("gar", catalog=catalog, image_size=16)  # the glob is listed through gcsfs
    assert [s.name for s in ar.shards] == ["00000.array_record", "00001.array_record", "00003.array_record"]
    source = SampleSource(ar)
    assert len(source) == 55
    assert [sample_at(source, i)["key"] for i in (0, 19, 54)] == [local[0], local[19], local[54]]


def test_missing_object_on_gs_is_file_not_found(bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_BUCKET", bucket)
    plan = datacat.resolve("gwds", catalog=_catalog(tmp_path), image_size=16, root="gs://datacat-test/nowhere")
    with pytest.raises(FileNotFoundError, match=r"nowhere/webdataset/0000\.tar"):
        read_all(SampleSource(plan))


def test_both_backends_read_gs_in_worker_processes(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from test_backends import run_ranks

    monkeypatch.setenv("TEST_BUCKET", bucket)
    catalog = _catalog(tmp_path)
    for name in ("gwds", "gar"):
        loader = datacat.open(
            name, framework="torch", batch_size=8, catalog=catalog, num_workers=2, image_size=16, val_batches=0
        )
        keys = [k for batch in loader for k in batch["key"]]
        assert len(keys) == 55 and len(set(keys)) == 55, name
    # grain's spawned workers reach the emulator through the inherited environment.
    loads = [[{"name": "gar", "batch_size": 8, "num_workers": 2, "image_size": 16, "val_batches": 0}]]
    env = {"DATACAT_CATALOG": str(tmp_path / "gcs.yaml"), "TEST_BUCKET": bucket}
    (result,) = run_ranks("jax", loads, env=env)[0]
    assert sum(len(b) for b in result["batches"]) == 55


def test_remote_array_records_are_read_by_chunk_index_or_else_by_the_cpp_client(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zstd shards: exact ranges from the chunk index; brotli (not decoded in Python): array_record's own client.

    Both give the records the local copy holds; a truncated shard is a ShardError naming it.
    """
    import gcsfs
    from array_record.python import array_record_module

    from datacat.formats.array_record import ArrayRecordReader

    monkeypatch.setenv("DATACAT_CACHE", str(tmp_path / "cache"))
    source = builtin_catalog_dir() / "sample" / "array_record" / "00000.array_record"
    reader = array_record_module.ArrayRecordReader(str(source))
    records = reader.read_all()
    reader.close()
    fs = gcsfs.GCSFileSystem(token="anon")
    for options in ("group_size:1,zstd:3", "group_size:4,zstd:3", "group_size:1,uncompressed", "group_size:1,brotli"):
        local = tmp_path / "shard.array_record"
        writer = array_record_module.ArrayRecordWriter(str(local), options)
        for record in records:
            writer.write(record)
        writer.close()
        fs.pipe(f"datacat-test/variants/{options.replace(',', '-')}.array_record", local.read_bytes())
    data = local.read_bytes()
    fs.pipe("datacat-test/variants/truncated.array_record", data[: len(data) // 2])
    (tmp_path / "v.yaml").write_text(
        "".join(
            f"v{i}: {{description: d, format: array_record, location: {{root: '{bucket}/variants', "
            f"shards: '{name}.array_record', storage_options: {{token: anon}}}}, record: {{layout: single}}}}\n"
            for i, name in enumerate(
                ("group_size:1-zstd:3", "group_size:4-zstd:3", "group_size:1-uncompressed", "group_size:1-brotli")
            )
        )
        + f"vbad: {{description: d, format: array_record, location: {{root: '{bucket}/variants', "
        "shards: 'truncated.array_record', storage_options: {token: anon}}, record: {layout: single}}\n"
    )
    catalog = datacat.load_catalog([tmp_path / "v.yaml"], builtin=False)
    for i, by_index in enumerate((True, True, True, False)):
        variant = ArrayRecordReader(datacat.resolve(f"v{i}", catalog=catalog, image_size=16))
        assert bool(variant.index_files) is by_index, i
        got = variant.items(list(range(len(records)))[::-1])
        assert [item.payload for item in got] == records[::-1], i  # type: ignore[union-attr]
    with pytest.raises(datacat.ShardError, match=r"truncated\.array_record.*Re-copy it"):
        ArrayRecordReader(datacat.resolve("vbad", catalog=catalog, image_size=16))


def test_convert_writes_shards_and_their_entry_to_a_bucket(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datacat.beam import pipeline_options
    from datacat.beam.convert import convert

    monkeypatch.setenv("TEST_BUCKET", bucket)
    local = [s["key"] for s in read_all(SampleSource(datacat.resolve("sample", image_size=16)))]
    written, counters = convert(
        "gwds",
        f"{bucket}/converted",
        catalog=_catalog(tmp_path),
        records_per_shard=20,
        options=pipeline_options(workers=1),
    )
    assert counters["records_written"] == 55
    assert "/catalogs/" in written  # a local copy of the entry in the bucket
    plan = datacat.resolve("gwds-converted", catalog=datacat.load_catalog([written]), image_size=16)
    assert plan.root == "gs://datacat-test/converted" and [s.samples for s in plan.shards] == [20, 20, 15]
    assert [s["key"] for s in read_all(SampleSource(plan))] == local
