from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import jpeg, make_array_record, sample_at

import datacat
from datacat.errors import RecordError, ShardError
from datacat.formats.ar_shards import count_records
from datacat.formats.array_record import ArrayRecordReader
from datacat.formats.packed import pack_record, unpack_pre_resized, unpack_record, unpack_views
from datacat.loading.sources import SampleSource


def _by_hand(entries: dict[str, bytes]) -> bytes:
    out = b""
    for key, value in entries.items():
        out += struct.pack("<I", len(key.encode())) + key.encode() + struct.pack("<I", len(value)) + value
    return out


def test_pack_round_trip_matches_hand_written_layout() -> None:
    entries = {"jpg": jpeg(1), "txt": "un café".encode(), "key": b"000123", "meta": b"{}"}
    packed = pack_record({**entries, "txt": "un café"})
    assert packed == _by_hand(entries)
    assert unpack_record(packed) == entries
    assert unpack_record(_by_hand(entries)) == entries
    assert list(unpack_record(packed)) == ["jpg", "txt", "key", "meta"]  # dict order kept
    views = unpack_views(packed)  # what the reader parses: the image is not copied out of its record
    assert views == entries and all(isinstance(v, memoryview) and v.obj is packed for v in views.values())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_by_hand({"jpg": b"x" * 50})[:-10], "truncated packed record: value of 'jpg' needs 50 bytes, 40 remain"),
        (_by_hand({"jpg": b"x"}) + b"\x01\x00", "2 stray byte"),
        (struct.pack("<I", 2) + b"\xff\xfe" + struct.pack("<I", 0), "not utf-8"),
        (struct.pack("<I", 1000) + b"abc", "key length 1000"),
        (_by_hand({"a": b"1"}) + _by_hand({"a": b"2"}), "appears twice"),
    ],
)
def test_bad_packed_records_say_what_is_wrong(data: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        unpack_record(data)


def test_pre_resized_layout() -> None:
    pixels = bytes(range(2 * 3 * 3))
    entries = unpack_record(_by_hand({"image": pixels, "shape": struct.pack("<ii", 2, 3), "caption": b"c"}))
    assert unpack_pre_resized(entries).shape == (2, 3, 3)
    with pytest.raises(ValueError, match="shape says 3x3x3"):
        unpack_pre_resized({"image": pixels, "shape": struct.pack("<ii", 3, 3)})


def test_shared_array_record_files_count(licensed_data: Path) -> None:
    assert count_records(str(licensed_data / "array_record" / "digits.array_record-00000-of-00001")) == 10
    assert count_records(str(licensed_data / "array_record" / "operators.array_record-00000-of-00001")) == 4


def test_shared_files_read_through_a_catalog_entry(licensed_data: Path, tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text(
        f"ops:\n  description: d\n  format: array_record\n  location: {{root: {licensed_data / 'array_record'}, "
        "shards: [digits.array_record-00000-of-00001, operators.array_record-00000-of-00001]}\n  record: {layout: single}\n"
    )
    plan = datacat.resolve("ops", catalog=datacat.load_catalog([tmp_path / "c.yaml"], builtin=False))
    reader = ArrayRecordReader(plan)
    assert len(reader) == 14 and reader.counts == (10, 4)
    assert bytes(reader.items([0])[0].payload).endswith(b"0") and bytes(reader.items([9])[0].payload).endswith(b"9")
    assert reader.items([10])[0].payload.endswith(b"+") and reader.items([13])[0].payload.endswith(b"/")
    assert reader.items([12])[0].key == "operators.array_record-00000-of-00001:2"


def _entry(tmp_path: Path, per_shard: str = "") -> datacat.Catalog:
    (tmp_path / "c.yaml").write_text(
        "t:\n  description: d\n  format: array_record\n  location: {root: ., shards: '{0..1}.ar'}\n"
        f"  record: {{layout: packed, key: key}}\n{per_shard}"
    )
    return datacat.load_catalog([tmp_path / "c.yaml"], builtin=False)


def _records(n: int, start: int = 0, bad: set[int] = frozenset()) -> list[bytes]:  # type: ignore[assignment]
    out = []
    for i in range(start, start + n):
        out.append(
            b"\x05\x00" if i in bad else pack_record({"key": f"k{i:03d}", "jpg": jpeg(i), "txt": f"caption {i}"})
        )
    return out


def test_records_across_shards_and_garbled_record(tmp_path: Path) -> None:
    make_array_record(tmp_path / "0.ar", _records(5, bad={3}))
    make_array_record(tmp_path / "1.ar", _records(4, start=5))
    plan = datacat.resolve("t", catalog=_entry(tmp_path), image_size=16, augmentation="none")
    source = SampleSource(plan)
    assert len(source) == 9
    assert sample_at(source, 6)["key"] == "k006" and sample_at(source, 6)["caption"] == "caption 6"
    with pytest.raises(RecordError, match=r"shard .*0\.ar, key 0\.ar:3: truncated packed record"):
        sample_at(source, 3)


def test_declared_counts_skip_opening_and_are_checked(tmp_path: Path) -> None:
    make_array_record(tmp_path / "0.ar", _records(5))
    make_array_record(tmp_path / "1.ar", _records(4, start=5))
    catalog = _entry(tmp_path, "  totals: {per_shard: {0.ar: 5, 1.ar: 3}}\n")
    reader = ArrayRecordReader(datacat.resolve("t", catalog=catalog))
    assert len(reader) == 8  # from the catalog, nothing opened yet
    assert not isinstance(reader.items([0])[0], Exception)
    with pytest.raises(ShardError, match=r"1\.ar has 4 records, the catalog declares 3"):
        reader.items([6])


def test_truncated_and_missing_shards(tmp_path: Path) -> None:
    make_array_record(tmp_path / "0.ar", _records(5))
    data = (tmp_path / "0.ar").read_bytes()
    (tmp_path / "1.ar").write_bytes(data[: len(data) // 2])
    with pytest.raises(ShardError, match=r"1\.ar cannot be read .*: it is truncated"):
        ArrayRecordReader(datacat.resolve("t", catalog=_entry(tmp_path)))
    (tmp_path / "1.ar").unlink()
    with pytest.raises(FileNotFoundError, match=r"1\.ar"):
        ArrayRecordReader(datacat.resolve("t", catalog=_entry(tmp_path)))


def test_a_damaged_chunk_is_a_skipped_sample_not_a_dead_epoch(tmp_path: Path) -> None:
    from helpers import jpeg

    import datacat
    from datacat.formats.packed import pack_record

    path = make_array_record(
        tmp_path / "0.ar",
        [pack_record({"jpg": jpeg(i, (64, 64)), "txt": f"c{i}", "key": f"k{i:02d}"}) for i in range(20)],
    )
    data = bytearray(path.read_bytes())
    data[20000:20064] = bytes(64)  # inside one record's chunk: its hash no longer matches
    path.write_bytes(bytes(data))
    (tmp_path / "c.yaml").write_text(
        "d: {description: d, format: array_record, location: {root: ., shards: [0.ar]}, record: {layout: packed, key: key}, "
        "loading: {val_batches: 0, image_size: 16, on_bad_sample: skip, bad_sample_budget: 0.2}}\n"
    )
    loader = datacat.open("d", framework="torch", batch_size=8, catalog=datacat.load_catalog([tmp_path / "c.yaml"]))
    keys = [k for b in loader for k in b["key"]]
    assert len(keys) == 19 and len(set(keys)) == 19
    (bad,) = loader.ledger.skipped
    assert bad.key == "0.ar:16" and bad.shard.endswith("0.ar") and "hash mismatch" in bad.reason


@pytest.mark.parametrize(
    ("options", "records"),
    [
        ("group_size:1", 60),
        ("group_size:5", 60),
        ("group_size:1,uncompressed", 60),
        ("group_size:1", 3000),
    ],
)
def test_python_chunk_index_reads_what_array_record_wrote(tmp_path: Path, options: str, records: int) -> None:
    from array_record.python import array_record_module

    from datacat.formats import riegeli

    rng = np.random.default_rng(records)
    big = records < 1000
    written = [rng.bytes(int(rng.integers(0, 150_000 if big else 20))) for _ in range(records)]
    path = tmp_path / "x.array_record"
    writer = array_record_module.ArrayRecordWriter(str(path), options)
    for record in written:
        writer.write(record)
    writer.close()
    data = path.read_bytes()
    index = riegeli.read_index(data[-riegeli.tail_size(len(data)) :], len(data))
    tail = data[-riegeli.BLOCK :]  # the postscript alone: the footer must be asked for
    with pytest.raises(riegeli.NeedMore) as more:
        riegeli.read_index(tail, len(data))
    assert riegeli.read_index(tail, len(data), data[more.value.offset : -len(tail)]).to_array().tolist() == (
        index.to_array().tolist()
    )
    assert len(index) == records
    for position in rng.permutation(records)[:200]:
        chunk, k = index.locate(int(position))
        start, end = int(index.starts[chunk]), int(index.ends[chunk])
        assert riegeli.decode_chunk(data[start:end], start)[k] == written[position]
    again = riegeli.ChunkIndex.from_array(index.to_array())
    assert again.locate(records - 1) == index.locate(records - 1)
    with pytest.raises(ValueError):  # a truncated copy: its last block is not a postscript
        riegeli.read_index(data[: len(data) // 2][-riegeli.tail_size(len(data) // 2) :], len(data) // 2)
    start, end = int(index.starts[-1]), int(index.ends[-1])
    with pytest.raises(ValueError, match=r"cut short|declares"):  # a range cut short by the network
        riegeli.decode_chunk(data[start : end - (end - start) // 2], start)
