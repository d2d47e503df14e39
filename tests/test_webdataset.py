from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from helpers import make_tar, read_all, sample_members

import datacat
from datacat.errors import RecordError, ShardError
from datacat.formats.tar import decode_member, group_by_key, split_key, tar_members
from datacat.formats.webdataset import TarStream
from datacat.loading.sources import SampleSource


def _catalog(tmp_path: Path, body: str) -> datacat.Catalog:
    path = tmp_path / "cat.yaml"
    path.write_text(body)
    return datacat.load_catalog([path], builtin=False)


def test_split_key_follows_webdataset() -> None:
    assert split_key("compressed/0001.txt.gz") == ("compressed/0001", "txt.gz")
    assert split_key("a/b.c/000.seg.png") == ("a/b.c/000", "seg.png")
    assert split_key("000000.mp") == ("000000", "mp")
    assert split_key("README") is None


def test_shared_compressed_tar(licensed_data: Path) -> None:
    url = str(licensed_data / "webdataset" / "compressed.tar")
    with open(url, "rb") as stream:
        samples = list(group_by_key(tar_members(stream, url), url))
    assert [k for k, _ in samples] == ["compressed/0001", "compressed/0002", "compressed/0003"]
    assert all(set(fields) == {"txt.gz"} for _, fields in samples)
    ext, text = decode_member("txt.gz", samples[0][1]["txt.gz"])
    assert ext == "txt" and isinstance(text, str) and text


def test_shared_msgpack_tar(licensed_data: Path) -> None:
    url = str(licensed_data / "webdataset" / "mpdata.tar")
    with open(url, "rb") as stream:
        samples = list(group_by_key(tar_members(stream, url), url))
    assert len(samples) == 100
    assert samples[0][0] == "000000" and samples[-1][0] == "000099"
    assert all(list(fields) == ["mp"] and isinstance(fields["mp"], bytes) for _, fields in samples)


def test_gzipped_tar_named_tar_is_detected_from_bytes(tmp_path: Path) -> None:
    make_tar(tmp_path / "0.tar", sample_members(["a", "b"]), compress=True)
    assert (tmp_path / "0.tar").read_bytes()[:2] == b"\x1f\x8b"
    catalog = _catalog(tmp_path, "t: {description: d, format: webdataset, location: {root: ., shards: 0.tar}}\n")
    samples = read_all(SampleSource(datacat.resolve("t", catalog=catalog, image_size=16)))
    assert [s["key"] for s in samples] == ["a", "b"] and samples[1]["caption"] == "caption of b"


def test_non_contiguous_or_repeated_keys_are_errors(tmp_path: Path) -> None:
    members = sample_members(["a", "b"])
    interleaved = [members[0], members[2], members[1], members[3]]  # a.jpg b.jpg a.txt b.txt
    url = str(make_tar(tmp_path / "x.tar", interleaved))
    with open(url, "rb") as stream, pytest.raises(RecordError, match=r"key 'a' appears again"):
        list(group_by_key(tar_members(stream, url), url))
    twice = [members[0], members[1], ("a.jpg", b"again")]
    url = str(make_tar(tmp_path / "y.tar", twice))
    with open(url, "rb") as stream, pytest.raises(RecordError, match=r"member .jpg twice"):
        list(group_by_key(tar_members(stream, url), url))


def test_truncated_tar_is_a_shard_error(tmp_path: Path) -> None:
    path = make_tar(tmp_path / "t.tar", sample_members([f"{i:03d}" for i in range(5)]))
    path.write_bytes(path.read_bytes()[:3000])
    with open(path, "rb") as stream, pytest.raises(ShardError, match=r"t\.tar"):
        list(tar_members(stream, str(path)))


def test_member_decoding(tmp_path: Path) -> None:
    import json

    import numpy as np

    array = io.BytesIO()
    np.save(array, np.arange(4, dtype=np.float32))
    members = [
        ("k.jpg", b"x"),
        ("k.txt", b"hi"),
        ("k.json", b'{"status": "success", "url": '),  # metadata cut short: not named by the entry
        ("k.cls", b" 7\n"),
        ("k.npy", array.getvalue()),
        ("k.weird", b"\x00\x01"),
        ("l.jpg", b"x"),
        ("l.txt", b"hi"),
        ("l.json", json.dumps({"a": 1}).encode()),
        ("l.cls", b"seven"),
        ("l.npy", array.getvalue()),
    ]
    make_tar(tmp_path / "0.tar", members)
    catalog = _catalog(
        tmp_path,
        "t: {description: d, format: webdataset, location: {root: ., shards: 0.tar}, record: {label: cls, embedding: npy}}\n",
    )
    reader = TarStream(datacat.resolve("t", catalog=catalog))
    first, second = reader.iter_shard(0)
    record = reader.parse(first)
    assert record["caption"] == "hi" and record["label"] == 7 and record["image"] == b"x"
    assert record["embedding"].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"member \.cls cannot be decoded"):
        reader.parse(second)  # a member the entry names is decoded, and refused when damaged
    json_keyed = _catalog(
        tmp_path,
        "j: {description: d, format: webdataset, location: {root: ., shards: 0.tar}, record: {label: cls, key: json}}\n",
    )
    reader = TarStream(datacat.resolve("j", catalog=json_keyed))
    with pytest.raises(ValueError, match=r"member \.json cannot be decoded"):
        reader.parse(next(reader.iter_shard(0)))


def test_skip_yields_every_good_sample_and_ledgers_the_bad(tmp_path: Path) -> None:
    keys = [f"{i:04d}" for i in range(12)]
    bad = {"0002", "0005", "0011"}
    make_tar(tmp_path / "0.tar", sample_members(keys, bad=bad))
    catalog = _catalog(tmp_path, "t: {description: d, format: webdataset, location: {root: ., shards: 0.tar}}\n")
    plan = datacat.resolve("t", catalog=catalog, image_size=16, on_bad_sample="skip", bad_sample_budget=0.5)
    source = SampleSource(plan)
    samples = read_all(source)
    assert [s["key"] for s in samples] == [k for k in keys if k not in bad]
    assert sorted(b.key for b in source.ledger.skipped) == sorted(bad)
    assert all(b.shard.endswith("0.tar") and "no decoder recognises" in b.reason for b in source.ledger.skipped)
    assert source.ledger.seen == 12

    strict = SampleSource(datacat.resolve("t", catalog=catalog, image_size=16))
    with pytest.raises(RecordError, match=r"shard .*0\.tar, key 0002: not a readable image"):
        read_all(strict)

    tight = SampleSource(
        datacat.resolve("t", catalog=catalog, image_size=16, on_bad_sample="skip", bad_sample_budget=0.1)
    )
    with pytest.raises(datacat.errors.BadSampleBudgetExceeded, match="over the budget"):
        read_all(tight)


@pytest.mark.parametrize("loading", [{"augmentation": "none"}, {"augmentation": "none", "resize": "pad"}, {}])
def test_a_batch_holds_each_good_sample_in_order_around_bad_ones(tmp_path: Path, loading: dict[str, str]) -> None:
    # Images are resized straight into the batch's rows; a bad sample's row is closed up, so every
    # row holds the pixels its sample has when made on its own.
    from datacat.loading.batches import BatchView
    from datacat.loading.epochs import Schedule

    keys = [f"{i:04d}" for i in range(10)]
    bad = {"0000", "0004", "0005"}
    make_tar(tmp_path / "0.tar", sample_members(keys, bad=bad))
    catalog = _catalog(tmp_path, "t: {description: d, format: webdataset, location: {root: ., shards: 0.tar}}\n")
    plan = datacat.resolve("t", catalog=catalog, image_size=24, on_bad_sample="skip", bad_sample_budget=0.5, **loading)
    source = SampleSource(plan)
    view = source.view(Schedule(10, 0, 10, (10,)), seed=0, epoch=0, shuffle=False)
    output = BatchView(view)[0]
    batch = output["batch"]
    alone = {s["key"]: s["image"] for s in read_all(SampleSource(plan))}
    assert batch["key"] == [k for k in keys if k not in bad] and len(output["marks"]) == len(bad)
    assert batch["image"].shape == (7, 24, 24, 3) and batch["image"].flags["C_CONTIGUOUS"]
    for key, pixels in zip(batch["key"], batch["image"], strict=True):
        np.testing.assert_array_equal(pixels, alone[key])
