"""Image folders and lists, holdout and count, embeddings, and the embedded sample."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from helpers import WriteCatalog, jpeg, read_all, sample_at

import datacat
from datacat.catalog import builtin_catalog_dir
from datacat.loading.options import LoadOptions
from datacat.loading.sources import SampleSource


def test_image_folder_with_captions_beside(tmp_path: Path, write_catalog: WriteCatalog) -> None:
    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    (tmp_path / "imgs" / "b.jpg").write_bytes(jpeg(1))
    (tmp_path / "imgs" / "b.txt").write_text("bee")
    (tmp_path / "imgs" / "sub" / "a.JPG").write_bytes(jpeg(2))
    (tmp_path / "imgs" / "sub" / "a.txt").write_text("ay")
    (tmp_path / "imgs" / "notes.md").write_text("ignored")
    catalog = datacat.load_catalog(
        [
            write_catalog(
                "f: {description: d, format: image_folder, location: {root: ., shards: [imgs]}, record: {layout: files}}\n",
            )
        ]
    )
    source = SampleSource(datacat.resolve("f", catalog=catalog, image_size=16))
    samples = [sample_at(source, i) for i in range(len(source))]
    assert [(s["key"], s["caption"]) for s in samples] == [("b", "bee"), ("sub/a", "ay")]


def test_image_list_tsv_without_header_and_csv_with(tmp_path: Path, write_catalog: WriteCatalog) -> None:
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(jpeg(i))
    (tmp_path / "list.tsv").write_text(f"{tmp_path / '0.jpg'}\tzero\n1.jpg\tone\n")
    (tmp_path / "list.csv").write_text("path,text\n2.jpg,two\nmissing.jpg,gone\n")
    catalog = datacat.load_catalog(
        [
            write_catalog(
                "tsv: {description: d, format: image_list, location: {root: ., shards: [list.tsv]}, record: {layout: table, image: '0', caption: '1'}}\n"
                "csv: {description: d, format: image_list, location: {root: ., shards: [list.csv]}, record: {layout: table, image: path, caption: text}, "
                "loading: {on_bad_sample: skip, bad_sample_budget: 0.5}}\n",
            )
        ]
    )
    tsv = SampleSource(datacat.resolve("tsv", catalog=catalog, image_size=16))
    assert [sample_at(tsv, i)["caption"] for i in range(len(tsv))] == ["zero", "one"]
    csv = SampleSource(datacat.resolve("csv", catalog=catalog, image_size=16))
    assert sample_at(csv, 0)["caption"] == "two" and sample_at(csv, 1) is None
    assert "missing.jpg" in csv.ledger.skipped[0].reason


def test_image_list_parquet(tmp_path: Path, write_catalog: WriteCatalog) -> None:
    pa = pytest.importorskip("pyarrow", reason="parquet image lists need pyarrow")
    import pyarrow.parquet as pq

    (tmp_path / "x.jpg").write_bytes(jpeg(5))
    pq.write_table(pa.table({"url": ["x.jpg"], "txt": ["from parquet"]}), tmp_path / "l.parquet")
    catalog = datacat.load_catalog(
        [
            write_catalog(
                "p: {description: d, format: image_list, location: {root: ., shards: [l.parquet]}, record: {layout: table, image: url, caption: txt}}\n",
            )
        ]
    )
    assert sample_at(SampleSource(datacat.resolve("p", catalog=catalog, image_size=16)), 0)["caption"] == "from parquet"


def test_labels_become_captions_and_tokenize_hook(tmp_path: Path, write_catalog: WriteCatalog) -> None:
    from helpers import make_tar

    make_tar(tmp_path / "0.tar", [("a.jpg", jpeg(0)), ("a.cls", b"1"), ("b.jpg", jpeg(1)), ("b.cls", b"0")])
    (tmp_path / "names.txt").write_text("rose\ntulip\n")
    catalog = datacat.load_catalog(
        [
            write_catalog(
                f"l:\n  description: d\n  format: webdataset\n  location: {{root: ., shards: 0.tar}}\n  record: {{caption: null, label: cls}}\n"
                f"  loading: {{captions: {{class_names: {tmp_path / 'names.txt'}, templates: ['a photo of a {{}}']}}}}\n",
            )
        ]
    )
    source = SampleSource(
        datacat.resolve("l", catalog=catalog, image_size=16),
        LoadOptions(batch_size=1, tokenize=lambda text: text.split()),
    )
    samples = read_all(source)
    assert [s["caption"] for s in samples] == ["a photo of a tulip", "a photo of a rose"]
    assert samples[0]["label"] == 1 and samples[0]["tokens"] == ["a", "photo", "of", "a", "tulip"]


def _keys(source: SampleSource) -> list[str]:
    return [s["key"] for s in read_all(source)]


@pytest.mark.parametrize("name", ["sample", "sample-arrayrecord"])
def test_holdout_and_count_select_from_the_head(name: str) -> None:
    everything = _keys(SampleSource(datacat.resolve(name)))
    assert len(everything) == 55
    train = _keys(SampleSource(datacat.resolve(name, batch_size=4, val_batches=2)))
    held = _keys(SampleSource(datacat.resolve(name, split="validation", batch_size=4, val_batches=2)))
    assert held == everything[:8] and train == everything[8:]
    counted = _keys(SampleSource(datacat.resolve(name, batch_size=4, val_batches=2, count=10)))
    assert counted == everything[8:18]


def test_holdout_bigger_than_the_data_is_refused() -> None:
    with pytest.raises(datacat.OptionError, match="is the whole dataset"):
        len(SampleSource(datacat.resolve("sample-arrayrecord", batch_size=64, val_batches=1)))


def test_embeddings_align_with_their_tar_shards() -> None:
    source = SampleSource(datacat.resolve("sample-embeddings"))
    samples = read_all(source)
    assert len(samples) == 55
    folder = builtin_catalog_dir() / "sample" / "embeddings"
    for sample in samples:
        shard, row = int(sample["key"][:4]), int(sample["key"][4:])
        expected = np.load(folder / f"img_emb_{shard:04d}.npy")[row]
        np.testing.assert_array_equal(sample["embedding"], expected)
        assert sample["embedding"].shape == (64,)


def test_sample_dataset_is_small_real_and_attributed() -> None:
    folder = builtin_catalog_dir() / "sample"
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size <= 3 * 2**20
    assert "CC-BY 2.0" in (folder / "SOURCES.md").read_text()
    tars = _keys(SampleSource(datacat.resolve("sample")))
    records = _keys(SampleSource(datacat.resolve("sample-arrayrecord")))
    assert tars == records and len(set(tars)) == 55
    caps = {s["key"]: s["caption"] for s in read_all(SampleSource(datacat.resolve("sample")))}
    assert caps["00000000"].startswith("a NASA portrait of astronaut Eileen Collins")


def _pixels(args: tuple[str, list[int]]) -> list[bytes]:
    name, indices = args
    source = SampleSource(datacat.resolve(name, image_size=32, seed=11))
    return [sample_at(source, i)["image"].tobytes() for i in indices]


@pytest.mark.slow
def test_same_record_same_pixels_in_0_1_and_2_worker_processes() -> None:
    indices = list(range(0, 55, 5))
    here = _pixels(("sample-arrayrecord", indices))
    context = multiprocessing.get_context("spawn")
    for workers in (1, 2):
        chunks = [indices[i::workers] for i in range(workers)]
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            results = list(pool.map(_pixels, [("sample-arrayrecord", c) for c in chunks]))
        got = {
            i: px for chunk, result in zip(chunks, results, strict=True) for i, px in zip(chunk, result, strict=True)
        }
        assert [got[i] for i in indices] == here, f"{workers} worker(s) gave other pixels"
    plain = SampleSource(datacat.resolve("sample-arrayrecord", image_size=32, seed=11, augmentation="none"))
    assert sum(sample_at(plain, i)["image"].tobytes() != px for i, px in zip(indices, here, strict=True)) == len(
        indices
    )


def test_embeddings_must_pair_with_their_tar_shards(tmp_path: Path, write_catalog: WriteCatalog) -> None:
    import shutil

    sample = builtin_catalog_dir() / "sample"
    shutil.copytree(sample / "webdataset", tmp_path / "webdataset")
    shutil.copytree(sample / "embeddings", tmp_path / "embeddings")
    path = write_catalog(
        "tars: {description: d, format: webdataset, location: {root: webdataset, shards: '{0000..0003}.tar', missing: [2, 3]}}\n"
        "embs: {description: d, format: embeddings, location: {root: embeddings, shards: 'img_emb_{0000..0003}.npy', missing: [2]},"
        " embeddings: {images: tars, dim: 64, index_width: 4}}\n"
    )
    catalog = datacat.load_catalog([path], builtin=False)
    with pytest.raises(
        datacat.ShardError, match=r"embedding files are for shards \[0, 1, 3\], but tars has tar shards \[0, 1\]"
    ):
        SampleSource(datacat.resolve("embs", catalog=catalog))


def test_sample_entries_declare_their_real_sizes() -> None:
    for name, sub in (
        ("sample", "webdataset"),
        ("sample-arrayrecord", "array_record"),
        ("sample-embeddings", "embeddings"),
    ):
        on_disk = sum(f.stat().st_size for f in (builtin_catalog_dir() / "sample" / sub).iterdir())
        assert datacat.load_catalog()[name].totals.bytes == on_disk
