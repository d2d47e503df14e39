"""TFDS-prepared folders: ArrayRecords of tf.train.Example, shard lengths from dataset_info.json, names beside them.

The Examples are written with the protobuf package from the same message
definitions as TensorFlow's ``example.proto`` (field numbers and packing),
so datacat's wire parser is checked against protobuf's own encoder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import jpeg, make_array_record

import datacat
from datacat.formats.tf_example import parse_example, shard_lengths

NAMES = ("pink primrose", "hard-leaved pocket orchid", "canterbury bells")
TRAIN, VALIDATION = (5, 4, 3), (4,)


def _example_class() -> Any:
    """tensorflow.Example as TensorFlow's example.proto and feature.proto define it, built at run time."""
    descriptor_pb2 = pytest.importorskip("google.protobuf.descriptor_pb2")
    from google.protobuf import descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="datacat_test_example.proto", package="tensorflow", syntax="proto3")

    def message(name: str, fields: list[tuple[str, int, int, int, str]]) -> Any:
        proto = file.message_type.add(name=name)
        for field, number, kind, label, type_name in fields:
            added = proto.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                added.type_name = type_name
        return proto

    message("BytesList", [("value", 1, F.TYPE_BYTES, F.LABEL_REPEATED, "")])
    message("FloatList", [("value", 1, F.TYPE_FLOAT, F.LABEL_REPEATED, "")])
    message("Int64List", [("value", 1, F.TYPE_INT64, F.LABEL_REPEATED, "")])
    feature = message(
        "Feature",
        [
            ("bytes_list", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.BytesList"),
            ("float_list", 2, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.FloatList"),
            ("int64_list", 3, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.Int64List"),
        ],
    )
    feature.oneof_decl.add(name="kind")
    for field in feature.field:
        field.oneof_index = 0
    features = message(
        "Features", [("feature", 1, F.TYPE_MESSAGE, F.LABEL_REPEATED, ".tensorflow.Features.FeatureEntry")]
    )
    entry = features.nested_type.add(name="FeatureEntry")
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(
        name="value", number=2, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".tensorflow.Feature"
    )
    entry.options.map_entry = True
    message("Example", [("features", 1, F.TYPE_MESSAGE, F.LABEL_OPTIONAL, ".tensorflow.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


def _example(cls: Any, image: bytes, label: int, file_name: str) -> bytes:
    example = cls()
    features = example.features.feature
    features["image"].bytes_list.value.append(image)
    features["label"].int64_list.value.append(label)
    features["file_name"].bytes_list.value.append(file_name.encode())
    return example.SerializeToString()  # type: ignore[no-any-return]


def _prepared(folder: Path) -> dict[str, tuple[int, str]]:
    """A TFDS version folder as `tfds build --file_format=array_record` leaves it; returns file_name -> (label, split)."""
    cls = _example_class()
    truth: dict[str, tuple[int, str]] = {}
    splits = []
    for split, lengths in (("train", TRAIN), ("validation", VALIDATION)):
        for shard, n in enumerate(lengths):
            records = []
            for i in range(n):
                name, label = f"image_{split}_{shard}_{i}.jpg", (shard * 7 + i) % len(NAMES)
                truth[name] = (label, split)
                records.append(_example(cls, jpeg(len(truth)), label, name))
            make_array_record(folder / f"flowers-{split}.array_record-{shard:05d}-of-{len(lengths):05d}", records)
        splits.append(
            {
                "name": split,
                "numBytes": "1",
                "shardLengths": [str(n) for n in lengths],
                "filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
            }
        )
    (folder / "dataset_info.json").write_text(
        json.dumps({"name": "flowers", "version": "2.1.1", "fileFormat": "array_record", "splits": splits})
    )
    (folder / "label.labels.txt").write_text("\n".join(NAMES) + "\n")
    return truth


def test_the_wire_parser_reads_what_protobuf_writes() -> None:
    cls = _example_class()
    example = cls()
    features = example.features.feature
    features["image"].bytes_list.value.extend([b"\xff\xd8 one", b""])
    features["label"].int64_list.value.extend([3, -2, 1 << 40])
    features["box"].float_list.value.extend([0.25, -1.5])
    features["empty"].int64_list.SetInParent()
    parsed = parse_example(example.SerializeToString())
    assert parsed == {"image": [b"\xff\xd8 one", b""], "label": [3, -2, 1 << 40], "box": [0.25, -1.5], "empty": []}
    with pytest.raises(ValueError, match="runs past"):
        parse_example(example.SerializeToString()[:-3])


def test_a_tfds_folder_loads_with_labels_keys_and_captions_from_its_own_files(tmp_path: Path) -> None:
    truth = _prepared(tmp_path)
    assert shard_lengths((tmp_path / "dataset_info.json").read_text()) == {
        "flowers-train.array_record-00000-of-00003": 5,
        "flowers-train.array_record-00001-of-00003": 4,
        "flowers-train.array_record-00002-of-00003": 3,
        "flowers-validation.array_record-00000-of-00001": 4,
    }
    (tmp_path / "c.yaml").write_text(
        "flowers:\n  description: d\n  format: array_record\n"
        "  location: {root: '.', shards: 'flowers-train.array_record-{00000..00002}-of-00003'}\n"
        "  splits: {validation: {root: '.', shards: 'flowers-validation.array_record-00000-of-00001'}}\n"
        "  record: {layout: tf_example, image: image, label: label, key: file_name, caption: null}\n"
        "  loading: {val_split: validation, image_size: 16, augmentation: none, captions: {templates: ['a photo of a {}']}}\n"
    )
    catalog = datacat.load_catalog([tmp_path / "c.yaml"], builtin=False)
    plan = datacat.resolve("flowers", catalog=catalog, batch_size=4)
    assert plan.samples is None  # no per_shard: the lengths come from dataset_info.json when the loader opens
    seen: dict[str, dict[str, list[Any]]] = {}
    for framework in ("torch", "jax"):
        loader = datacat.open("flowers", framework=framework, batch_size=4, catalog=catalog, epochs=1)
        got: dict[str, list[Any]] = {"key": [], "label": [], "caption": [], "image": []}
        for batch in loader:
            got["key"] += list(batch["key"])
            got["label"] += [int(x) for x in np.asarray(batch["label"])]
            got["caption"] += list(batch["caption"])
            got["image"] += list(np.asarray(batch["image"]))
        seen[framework] = got
        train = sorted(k for k, (_, split) in truth.items() if split == "train")
        assert sorted(got["key"]) == train, framework  # every train record once, keyed by its file_name
        assert got["label"] == [truth[k][0] for k in got["key"]]
        assert got["caption"] == [f"a photo of a {NAMES[truth[k][0]]}" for k in got["key"]]
        held = datacat.open("flowers", framework=framework, batch_size=4, catalog=catalog, split="validation")
        validation = [k for b in held for k in b["key"]]
        assert sorted(validation) == sorted(k for k, (_, s) in truth.items() if s == "validation")
    torch_pixels = dict(zip(seen["torch"]["key"], seen["torch"]["image"], strict=True))
    for key, pixels in zip(seen["jax"]["key"], seen["jax"]["image"], strict=True):
        np.testing.assert_array_equal(pixels, torch_pixels[key])  # the same pixels in both frameworks


def test_a_tfds_folder_without_its_dataset_info_says_what_to_do(tmp_path: Path) -> None:
    _prepared(tmp_path)
    (tmp_path / "dataset_info.json").unlink()
    (tmp_path / "c.yaml").write_text(
        "flowers: {description: d, format: array_record, location: {root: '.', shards: "
        "'flowers-train.array_record-{00000..00002}-of-00003'}, record: {layout: tf_example, caption: null}, "
        "loading: {val_batches: 0}}\n"
    )
    catalog = datacat.load_catalog([tmp_path / "c.yaml"], builtin=False)
    with pytest.raises(FileNotFoundError, match=r"dataset_info\.json not found.*declare per_shard"):
        datacat.open("flowers", framework="torch", batch_size=4, catalog=catalog)


def test_class_names_are_read_relative_to_the_catalog_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = datacat.resolve("OxfordFlowers", list_shards=False)  # a bucket glob: not listed here
    names = Path(str(plan.loading.captions.class_names))
    assert names.is_absolute() and len(names.read_text().splitlines()) == 102  # shipped beside the built-in entry
    (tmp_path / "entries").mkdir()
    (tmp_path / "entries" / "names.txt").write_text("a\nb\n")
    (tmp_path / "entries" / "c.yaml").write_text(
        "x: {description: d, format: image_folder, location: {root: '.', shards: [imgs]}, "
        "loading: {captions: {class_names: names.txt}}}\n"
    )
    monkeypatch.chdir(tmp_path)  # not the catalog's folder
    plan = datacat.resolve("x", catalog=datacat.load_catalog([tmp_path / "entries" / "c.yaml"], builtin=False))
    assert plan.loading.captions.class_names == str(tmp_path / "entries" / "names.txt")
