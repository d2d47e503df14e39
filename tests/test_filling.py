"""The batch path (pre-resized pixels, embedding rows read straight into a batch) gives what the record path gives."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import datacat
from datacat.formats.array_record import ArrayRecordReader
from datacat.formats.packed import pack_record, unpack_record

SIZE = 16


def _pixels(i: int, size: int = SIZE) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (size, size, 3), dtype=np.uint8)


def _write(path: Path, records: list[bytes], options: str = "group_size:1,uncompressed") -> None:
    from array_record.python import array_record_module

    writer = array_record_module.ArrayRecordWriter(str(path), options)
    for record in records:
        writer.write(record)
    writer.close()


def _record(i: int, *, size: int = SIZE, short: bool = False) -> bytes:
    image = _pixels(i, size).tobytes()
    return pack_record(
        {
            "image": image[:-1] if short else image,
            "shape": struct.pack("<ii", size, size),
            "caption": f"caption {i}",
            "key": f"k{i:04d}",
            "label": str(i % 7),
        }
    )


@pytest.fixture
def pre_resized(tmp_path: Path) -> Path:
    """Three shards: plain (one record of another size, one cut short), plain again, and zstd-compressed."""
    plain = [_record(i, size=SIZE + 4 if i == 5 else SIZE, short=i == 9) for i in range(20)]
    _write(tmp_path / "0000.array_record", plain)
    _write(tmp_path / "0001.array_record", [_record(i) for i in range(20, 40)])
    _write(tmp_path / "0002.array_record", [_record(i) for i in range(40, 50)], "group_size:1")  # zstd
    catalog = tmp_path / "c.yaml"
    catalog.write_text(
        "px:\n  description: d\n  format: array_record\n"
        "  location: {root: ., shards: '{0000..0002}.array_record'}\n"
        "  record: {layout: pre_resized, key: key}\n"
        f"  loading: {{image_size: {SIZE}, val_batches: 0, augmentation: flip_only}}\n"
    )
    return catalog


def _epochs(catalog: Path, name: str, *, fill: bool, **options: Any) -> tuple[list[dict[str, Any]], Any]:
    options.setdefault("epochs", 2)
    loader = datacat.open(name, catalog=datacat.load_catalog(catalog), framework="torch", **options)
    if not fill:
        loader.source.fill = None  # every record through the record path
    batches = [{k: (v.numpy().copy() if hasattr(v, "numpy") else v) for k, v in batch.items()} for batch in loader]
    return batches, loader


def _plain(value: Any) -> Any:
    """A batch's array as a numpy copy (torch tensors and jax arrays alike); other values as they are."""
    if hasattr(value, "numpy") and callable(value.numpy):
        return value.numpy().copy()
    return np.asarray(value).copy() if hasattr(value, "shape") else value


def _count_items(monkeypatch: pytest.MonkeyPatch, reader: type) -> list[int]:
    """The positions ``reader.items`` is asked for from now on (the record path), in this process."""
    asked: list[int] = []
    items = reader.items  # type: ignore[attr-defined]

    def counted(self: Any, indices: Any) -> Any:
        asked.extend(indices)
        return items(self, indices)

    monkeypatch.setattr(reader, "items", counted)
    return asked


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            if isinstance(x[key], np.ndarray):
                assert x[key].dtype == y[key].dtype and np.array_equal(x[key], y[key]), key
            else:
                assert x[key] == y[key], key


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_pre_resized_batches_equal_the_record_paths_and_only_the_odd_records_take_it(
    pre_resized: Path, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {"batch_size": 8, "seed": 5, "num_workers": workers, "on_bad_sample": "skip", "bad_sample_budget": 0.5}
    expected, _ = _epochs(pre_resized, "px", fill=False, **options)
    asked = _count_items(monkeypatch, ArrayRecordReader)
    got, loader = _epochs(pre_resized, "px", fill=True, **options)
    _same(got, expected)  # keys, captions, labels, flipped pixels, the record resized, the bad one skipped
    keys = [k for batch in got for k in batch["key"]]
    assert len(keys) == 2 * 49 and "k0009" not in keys and len(set(keys)) == 49
    assert [s.key for s in loader.ledger.skipped] == ["0000.array_record:9"] * 2  # its key entry is past the cut
    assert loader.num_workers == 0  # flips only: two threads of this process fill it, no worker copies it again
    # Counted in this process: the odd size, the short one and the compressed shard's ten.
    assert sorted(set(asked)) == [5, 9, *range(40, 50)]


def test_small_entries_read_what_unpack_record_reads_and_no_garbled_record() -> None:
    from datacat.formats.ar_pixels import small_entries

    record = pack_record({"shape": struct.pack("<ii", 4, 4), "caption": "a cat", "key": "k1", "label": "3"})
    assert small_entries(record) == {key.encode(): value for key, value in unpack_record(record).items()}
    assert small_entries(b"") == {}
    not_utf8 = record + struct.pack("<I", 2) + b"\xff\xfe" + struct.pack("<I", 0)
    for garbled in (record[:-1], record[:3], record + b"\0", record + record, not_utf8):  # cut, stray, twice, name
        assert small_entries(garbled) is None
        with pytest.raises(ValueError):
            unpack_record(garbled)


def test_workers_are_kept_where_colour_jitter_follows_the_copy(pre_resized: Path) -> None:
    catalog = datacat.load_catalog(pre_resized)
    for augmentation, workers in (("flip_jitter", 2), ("flip_only", 0), ("none", 0)):
        loader = datacat.open(
            "px", catalog=catalog, framework="torch", batch_size=8, num_workers=2, augmentation=augmentation
        )
        assert loader.num_workers == workers, augmentation
        loader.close()


def test_a_batch_held_by_the_loop_is_never_written_over(pre_resized: Path) -> None:
    loader = datacat.open(
        "px", catalog=datacat.load_catalog(pre_resized), framework="torch", batch_size=4, epochs=3, seed=1,
        num_workers=0, on_bad_sample="skip", bad_sample_budget=0.5,
    )  # fmt: skip
    held = list(loader)  # every batch kept: none may share memory with a later one
    copies = [batch["image"].clone() for batch in held]
    expected, _ = _epochs(pre_resized, "px", fill=False, batch_size=4, epochs=3, seed=1, num_workers=0,
                          on_bad_sample="skip", bad_sample_budget=0.5)  # fmt: skip
    for batch, copy, want in zip(held, copies, expected, strict=True):
        assert np.array_equal(batch["image"].numpy(), copy.numpy())
        assert np.array_equal(batch["image"].numpy(), want["image"])


@pytest.mark.parametrize("size", [SIZE, 160])  # pixels of 768 bytes, long captions; 76,800 bytes across blocks
def test_records_across_block_boundaries_are_read_whole(
    tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Riegeli puts a header every 64 KiB: wherever it falls in a record (heads, pixels, caption), the fill reads it right."""
    from datacat.formats import ar_pixels

    rng = np.random.default_rng(size)
    records = [
        pack_record({"image": _pixels(i, size).tobytes(), "shape": struct.pack("<ii", size, size),
                     "caption": "c" * int(rng.integers(1, 3000 if size == SIZE else 400)), "key": f"k{i:04d}"})
        for i in range(600 if size == SIZE else 60)
    ]  # fmt: skip
    _write(tmp_path / "0000.array_record", records)
    (tmp_path / "c.yaml").write_text(
        "px:\n  description: d\n  format: array_record\n  location: {root: ., shards: 0000.array_record}\n"
        f"  record: {{layout: pre_resized, key: key}}\n  loading: {{image_size: {size}, val_batches: 0}}\n"
    )
    loader = datacat.open("px", catalog=datacat.load_catalog(tmp_path / "c.yaml"), framework="torch", batch_size=8)
    fill = loader.source.fill
    assert isinstance(fill, ar_pixels.PreResizedFill)
    alone: list[int] = []
    without = ar_pixels.riegeli.without_block_headers

    def counted(data: bytes, start: int) -> bytes:
        alone.append(start)
        return without(data, start)

    monkeypatch.setattr(ar_pixels.riegeli, "without_block_headers", counted)
    order = rng.permutation(len(records))
    out = {"image": np.zeros((len(records), size, size, 3), np.uint8)}
    filled = fill.fill(order, out)
    monkeypatch.undo()
    loader.close()
    assert filled.left == {}
    for slot, i in enumerate(order.tolist()):
        assert np.array_equal(out["image"][slot], _pixels(i, size)), i
        assert filled.fields["key"][slot] == f"k{i:04d}"
        assert filled.fields["caption"][slot] == unpack_record(records[i])["caption"].decode()
    # Only the records whose heads or other entries cross a block boundary have a block header taken out; there are some.
    assert 0 < len(alone) < len(records) // 2


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_next_epoch_is_read_while_the_last_batches_of_one_are_taken(
    pre_resized: Path, framework: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from datacat.loading.batches import BatchView

    options = {
        "batch_size": 4,
        "epochs": 3,
        "seed": 1,
        "num_workers": 0,
        "on_bad_sample": "skip",
        "bad_sample_budget": 0.5,
    }
    expected, _ = _epochs(pre_resized, "px", fill=False, **options)
    fetched: list[tuple[int, int, str]] = []
    fetch = BatchView._fetch

    def recorded(self: BatchView, batch: int) -> Any:
        fetched.append((self.view.epoch, batch, threading.current_thread().name))
        return fetch(self, batch)

    monkeypatch.setattr(BatchView, "_fetch", recorded)
    loader = datacat.open("px", catalog=datacat.load_catalog(pre_resized), framework=framework, **options)
    batches = [{k: _plain(v) for k, v in batch.items()} for batch in loader]
    _same(batches, expected)
    # Every batch read once, each by a read thread: the first of epochs 1 and 2 too (only epoch 0's first is asked cold).
    assert sorted((e, b) for e, b, _ in fetched) == sorted({(e, b) for e, b, _ in fetched})
    assert [(e, b) for e, b, thread in fetched if not thread.startswith("datacat-read")] == [(0, 0)]

    # Left just before an epoch's end (the next one's first batches already being read), then continued.
    loader = datacat.open("px", catalog=datacat.load_catalog(pre_resized), framework=framework, **options)
    per_epoch = len(loader)
    taken = [{k: _plain(v) for k, v in batch.items()} for batch in itertools.islice(loader, per_epoch - 1)]
    state = loader.state_dict()
    loader.load_state_dict(state)
    _same(taken + [{k: _plain(v) for k, v in batch.items()} for batch in loader], expected)


@pytest.fixture
def table(tmp_path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for sub in ("img_emb", "text_emb", "metadata"):
        (tmp_path / sub).mkdir()
    for shard in range(3):
        image = np.random.default_rng(shard).standard_normal((30, 12)).astype(np.float16)
        if shard == 1:
            image[4] = 0  # a row the embedding job could not compute
        np.save(tmp_path / "img_emb" / f"img_emb_{shard:04d}.npy", image)
        np.save(tmp_path / "text_emb" / f"text_emb_{shard:04d}.npy", image[:, ::-1].copy())
        pq.write_table(
            pa.table({"caption": [f"{shard}/{i}" for i in range(30)]}),
            tmp_path / "metadata" / f"metadata_{shard:04d}.parquet",
        )
    catalog = tmp_path / "c.yaml"
    catalog.write_text(
        "emb:\n  description: d\n  format: embedding_table\n  location: {root: ., shards: '{0000..0002}'}\n"
        "  prior: {dim: 12, validation_rows: [10, 20]}\n"
    )
    return catalog


@pytest.mark.parametrize(
    ("workers", "run", "held"),
    [(0, 1, True), (0, 8, True), (0, 8, False), pytest.param(2, 1, True, marks=pytest.mark.slow)],
)
def test_embedding_rows_equal_the_record_paths(
    table: Path, workers: int, run: int, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datacat.formats.embedding_table import EmbeddingTableReader

    if not held:  # the whole table is the training split: a position is its row
        table.write_text(table.read_text().replace(", validation_rows: [10, 20]", ""))
    rows = 79 if held else 89  # 90 rows, 10 held for validation, 1 all zeros
    options = {"batch_size": 16, "seed": 2, "num_workers": workers, "on_bad_sample": "skip", "bad_sample_budget": 0.5}
    options["shuffle_run"] = run
    expected, _ = _epochs(table, "emb", fill=False, **options)
    asked = _count_items(monkeypatch, EmbeddingTableReader)
    got, loader = _epochs(table, "emb", fill=True, **options)
    assert loader.num_workers == 0  # a gather: two threads of this process fill it, no worker copies it again
    if workers == 0:
        assert sorted(set(asked)) == [24 if held else 34]  # only the all-zero row (row 34 of the table) is read alone
    _same(got, expected)
    keys = [k for batch in got for k in batch["key"]]
    assert len(keys) == 2 * rows and "0001:4" not in keys
    assert got[0]["image_embedding"].dtype == np.float16  # the table's own dtype
    inside = [k for k in keys if k.startswith("0000:") and 10 <= int(k.split(":")[1]) < 20]
    assert len(inside) == (0 if held else 20)
    for epoch in (got[: len(got) // 2], got[len(got) // 2 :]):  # each row once an epoch, in either order
        assert len({k for batch in epoch for k in batch["key"]}) == rows
    if run > 1:  # neighbours moved together: a batch of 16 is two stretches of 8, give or take a boundary
        for batch in got:
            rows_of = [(k.split(":")[0], int(k.split(":")[1])) for k in batch["key"]]
            stretches = 1 + sum(b != (a[0], a[1] + 1) for a, b in itertools.pairwise(rows_of))
            assert stretches <= 5, batch["key"]


def test_a_batchs_captions_are_picked_when_read_and_travel_as_a_list() -> None:
    import pickle

    import pyarrow as pa

    from datacat.formats.table_rows import ArrowColumn

    column = pa.array(["a", "b", "c", "d"])
    captions = ArrowColumn(column, np.asarray([3, 0, 0]))
    assert len(captions) == 3 and captions._list is None  # nothing taken until read
    assert captions == ["d", "a", "a"] and captions[1:] == ["a", "a"] and list(captions) == ["d", "a", "a"]
    copied = pickle.loads(pickle.dumps(captions))
    assert copied == ["d", "a", "a"] and len(copied) == 3 and copied[0] == "d"


def test_stretches_break_where_rows_stop_following_or_the_file_changes() -> None:
    from datacat.formats.table_rows import stretches

    files = np.asarray([0] * 8 + [1] * 8 + [1] * 8)
    rows = np.asarray([*range(22, 30), *range(0, 8), *range(20, 28)])  # 29 then row 0 of the next file, then a jump
    assert stretches(files, rows) == [0, 8, 16, 24]
    assert stretches(np.zeros(8, np.int64), np.asarray([5, 3, 9, 1, 7, 2, 8, 0])) is None  # scattered: one fancy index
    assert stretches(np.asarray([0, 1]), np.asarray([29, 30])) is None  # [0, 1, 2]: a stretch of one row each


def test_runs_of_neighbours_resume_exactly_on_any_world_and_refuse_another_run(table: Path) -> None:
    import json

    catalog = datacat.load_catalog(table)

    def opened(**options: Any) -> Any:
        options = {"batch_size": 8, "epochs": 2, **options}
        return datacat.open(
            "emb", catalog=catalog, framework="torch", seed=3, on_bad_sample="skip", bad_sample_budget=0.5, **options
        )

    whole = [list(batch["key"]) for batch in opened(shuffle_run=8)]
    stopped = opened(shuffle_run=8)
    batches = iter(stopped)
    before = [list(next(batches)["key"]) for _ in range(4)]
    state = json.loads(json.dumps(stopped.state_dict()))
    assert before == whole[:4] and state["shuffle_run"] == 8
    resumed = opened(shuffle_run=8)
    resumed.load_state_dict(state)
    assert before + [list(batch["key"]) for batch in resumed] == whole  # exactly on, across the epoch boundary
    # On two ranks of batch 4 (elastic): the rest of the first epoch, each row once, in the global order.
    ranks = [opened(shuffle_run=8, batch_size=4, rank=r, world_size=2, epochs=1) for r in range(2)]
    for rank in ranks:
        rank.load_state_dict(state)
    rest = [[list(batch["key"]) for batch in rank] for rank in ranks]
    steps = [k for pair in zip(*rest, strict=True) for batch in pair for k in batch]
    first_epoch = [k for batch in whole[: len(whole) // 2] for k in batch]
    assert steps == first_epoch[sum(map(len, before)) :]
    with pytest.raises(datacat.errors.PlanMismatch, match="shuffle_run"):
        opened(shuffle_run=1).load_state_dict(state)


def test_pace_reads_ahead_while_the_loop_is_away_and_in_the_loop_while_it_waits() -> None:
    from datacat.loading.pace import Pace

    pace = Pace()
    assert pace.ahead  # nothing measured yet
    for _ in range(3):  # the loop comes back at once and waits for nearly the whole read
        pace.read(1e-3)
        pace.away(1e-5)
        pace.waited(0.9e-3)
    assert not pace.ahead
    pace.away(0.2e-3)  # a loop away a fifth of a read: still better off reading itself
    assert not pace.ahead
    for _ in range(3):  # its step grew past half a read: the thread hides the read behind it
        pace.read(1e-3)
        pace.away(2e-3)
    assert pace.ahead and pace.wait_s is None
    pace.waited(0.1e-3)  # waiting a little for a batch read ahead keeps reading ahead
    assert pace.ahead
    pace.away(3600.0)  # an hour's pause counts as two reads, no more
    assert pace.away_s is not None and pace.away_s < 1e-2


def test_rows_in_runs_are_read_by_the_loop_that_waits_and_ahead_for_one_that_works(
    table: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    from datacat.formats.table_rows import RowsFill

    fill = RowsFill.fill
    readers: list[str] = []

    def slow(self: RowsFill, positions: np.ndarray, out: Any) -> Any:
        readers.append(threading.current_thread().name)
        time.sleep(0.005)  # a batch whose read takes 5 ms
        return fill(self, positions, out)

    monkeypatch.setattr(RowsFill, "fill", slow)
    options = {"batch_size": 4, "seed": 2, "epochs": 2, "num_workers": 0, "shuffle_run": 4}
    options |= {"on_bad_sample": "skip", "bad_sample_budget": 0.5}
    catalog = datacat.load_catalog(table)
    waits = [list(batch["key"]) for batch in datacat.open("emb", catalog=catalog, framework="torch", **options)]
    in_loop = sum(not name.startswith("datacat-read") for name in readers)
    assert in_loop >= 0.75 * len(readers), readers  # read ahead at first, then by the loop itself
    readers.clear()
    both, wait_first = [], 12
    for batch in datacat.open("emb", catalog=catalog, framework="jax", **options):
        both.append(list(batch["key"]))
        if len(both) > wait_first:
            time.sleep(0.02)  # then a training step four reads long
    assert not readers[wait_first - 2].startswith("datacat-read"), readers  # the loop waited: it read itself
    # Its step hides the reads. A read thread held up past a step (a busy machine) hands one read back to the
    # loop, which reads ahead again after its next step: a blip costs at most two reads.
    assert sum(not name.startswith("datacat-read") for name in readers[-12:]) <= 2, readers
    assert waits == both  # the same batches whichever thread read them


def test_row_keys_read_as_the_list_of_keys_they_stand_for() -> None:
    from datacat.formats.table_rows import RowKeys

    keys = RowKeys(["0000", "0001"], np.asarray([0, 1, 1]), np.asarray([4, 0, 17]))
    expected = ["0000:4", "0001:0", "0001:17"]
    assert keys == expected and list(keys) == expected and len(keys) == 3
    assert keys[1] == "0001:0" and keys[-1] == "0001:17" and keys[1:] == expected[1:]
    assert keys != ["0000:4"] and keys != "0000:4" and keys != expected[::-1]
    with pytest.raises(TypeError):
        hash(keys)
    with pytest.raises(IndexError):
        keys[3]


@pytest.mark.parametrize("dim", [64, 12])  # 128-byte rows: units of np.take; 24-byte rows at odd addresses: whole rows
def test_row_gather_reads_each_files_rows_in_any_order_and_mix(tmp_path: Path, dim: int) -> None:
    from datacat.formats.embedding_table import npy_header
    from datacat.formats.table_rows import RowGather, stretches

    tables = [np.random.default_rng(f).standard_normal((n, dim)).astype(np.float16) for f, n in enumerate((7, 30, 1))]
    paths = []
    for f, table in enumerate(tables):
        paths.append(str(tmp_path / f"t{f}.npy"))
        np.save(paths[-1], table)
    offsets = [npy_header(Path(p).read_bytes()[:4096], p)[2] for p in paths]
    gather = RowGather(paths, offsets, dim * 2)
    assert (gather.unit >= 32) == (dim == 64)
    rng = np.random.default_rng(0)
    for order in ("scattered", "runs"):
        if order == "scattered":
            files = rng.integers(0, 3, 40)
            rows = np.asarray([rng.integers(0, len(tables[f])) for f in files.tolist()])
        else:  # rows 5..24 of file 1, 2..6 of file 0 (its last), 20..29 of file 1: three stretches
            files = np.asarray([1] * 20 + [0] * 5 + [1] * 10)
            rows = np.asarray([*range(5, 25), *range(2, 7), *range(20, 30)])
        out = np.full((len(rows), dim), np.nan, np.float16)
        bounds = stretches(files, rows)
        assert bounds == (None if order == "scattered" else [0, 20, 25, 35])
        gather.gather(files, rows, out, bounds)
        expected = np.stack([tables[f][r] for f, r in zip(files.tolist(), rows.tolist(), strict=True)])
        assert out.tobytes() == expected.tobytes(), order
