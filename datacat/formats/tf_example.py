"""TFDS-prepared records: ``tf.train.Example`` parsed without TensorFlow, shard lengths from ``dataset_info.json``.

``tfds build --file_format=array_record`` writes a version folder
(``oxford_flowers102/2.1.1/``) holding ArrayRecord shards named
``{dataset}-{split}.array_record-{i:05d}-of-{n:05d}``, whose records are
serialized ``tf.train.Example`` protos, a ``dataset_info.json`` with each
split's shard lengths, and ``label.labels.txt`` with the class names.

An Example is three nested messages (``Example.features`` → ``Features.feature``,
a map of name to ``Feature``, whose oneof is a ``BytesList``, ``FloatList``
or ``Int64List``): parsed here directly from the protobuf wire format,
which needs neither TensorFlow nor generated proto classes.
tensorflow-datasets' ``ExampleParserNp`` would parse them without
TensorFlow too (it ships its own ``tf_example_pb2``), but it needs the
dataset's feature specs and the whole tensorflow-datasets package in every
worker; a sixty-line wire parser needs nothing.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

from datacat.errors import ShardError
from datacat.formats.wire import fields, varint
from datacat.schema import Record
from datacat.storage import read_bytes

__all__ = ["example_record", "parse_example", "shard_lengths", "tfds_lengths"]

Feature = list[bytes] | list[int] | list[float]


def parse_example(data: bytes) -> dict[str, Feature]:
    """The features of one serialized ``tf.train.Example``, by name: a list of bytes, ints or floats each."""
    features: dict[str, Feature] = {}
    for number, value in fields(data):
        if number != 1 or not isinstance(value, bytes):  # Example.features
            continue
        for entry_number, entry in fields(value):
            if entry_number != 1 or not isinstance(entry, bytes):  # Features.feature (a map entry)
                continue
            name, feature = b"", b""
            for field, part in fields(entry):
                if field == 1 and isinstance(part, bytes):
                    name = part
                elif field == 2 and isinstance(part, bytes):
                    feature = part
            features[name.decode("utf-8")] = _feature(feature)
    return features


def _feature(data: bytes) -> Feature:
    for kind, values in fields(data):
        if not isinstance(values, bytes):
            raise ValueError("a tf.train.Feature holds no list")
        items = [v for n, v in fields(values) if n == 1]
        if kind == 1:  # BytesList
            return [v for v in items if isinstance(v, bytes)]
        if kind == 3:  # Int64List: packed (one bytes item) or not (ints)
            out: list[int] = []
            for v in items:
                if isinstance(v, bytes):
                    out.extend(_packed_varints(v))
                else:
                    out.append(_signed(int(v)))
            return out
        if kind == 2:  # FloatList: packed little-endian float32, or fixed32 items
            floats: list[float] = []
            for v in items:
                raw = v if isinstance(v, bytes) else struct.pack("<I", int(v))
                floats.extend(x for (x,) in struct.iter_unpack("<f", raw))
            return floats
    return []


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _packed_varints(data: bytes) -> list[int]:
    out, pos = [], 0
    while pos < len(data):
        value, pos = varint(data, pos)
        out.append(_signed(value))
    return out


def shard_lengths(info: str | bytes | Mapping[str, Any]) -> dict[str, int]:
    """Records per shard file name, from a TFDS ``dataset_info.json`` (its text or parsed), every split."""
    data = json.loads(info) if isinstance(info, str | bytes) else info
    name = data.get("name", "")
    file_format = data.get("fileFormat", "array_record")
    out: dict[str, int] = {}
    for split in data.get("splits", []):
        lengths = [int(n) for n in split.get("shardLengths", [])]
        template = split.get("filepathTemplate") or "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}"
        for i, n in enumerate(lengths):
            file = (
                template.replace("{DATASET}", name)
                .replace("{SPLIT}", split["name"])
                .replace("{FILEFORMAT}", file_format)
                .replace("{SHARD_X_OF_Y}", f"{i:05d}-of-{len(lengths):05d}")
                .replace("{SHARD_INDEX}", f"{i:05d}")
                .replace("{NUM_SHARDS}", f"{len(lengths):05d}")
            )
            out[file] = n
    return out


def tfds_lengths(root: str, storage_options: dict[str, Any]) -> dict[str, int]:
    """Records per shard file name of the TFDS folder ``root``, from its ``dataset_info.json``."""
    url = root.rstrip("/") + "/dataset_info.json"
    try:
        return shard_lengths(read_bytes(url, storage_options))
    except FileNotFoundError:
        raise FileNotFoundError(
            2,
            f"{url} not found: a tf_example entry without totals.per_shard reads its shard lengths from the "
            "dataset_info.json that `tfds build` writes beside the shards; copy it there or declare per_shard",
            url,
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ShardError(f"{url} is not a TFDS dataset_info.json: {exc}", url=url) from None


def example_record(payload: bytes, record: Record, out: dict[str, Any]) -> dict[str, Any]:
    """``out`` completed with one Example's image (``record.image``, else ``image``), label, key and caption."""
    features = parse_example(payload)
    image_key = record.image if record.image in features else "image"  # the schema's default ("jpg") is no feature
    images = features.get(image_key)
    out["image"] = images[0] if images else None
    caption = features.get(record.caption) if record.caption else None
    out["caption"] = caption[0].decode("utf-8").strip() if caption and isinstance(caption[0], bytes) else None
    label = features.get(record.label or "label")
    if label:
        out["label"] = int(label[0])
    key = features.get(record.key or "file_name")
    if key and isinstance(key[0], bytes):
        out["__key__"] = key[0].decode("utf-8", "replace")
    out["entries"] = features
    return out
