"""Tars read by member index: record-level shuffle across shards, and damage found instead of a short shard."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
from helpers import make_tar, sample_members

import datacat


def _entry(tmp_path: Path, shards: int, per_shard: int, declare: bool = True) -> datacat.Catalog:
    names = [f"{s:02d}.tar" for s in range(shards)]
    for s, name in enumerate(names):
        make_tar(tmp_path / name, sample_members([f"{s:02d}{i:03d}" for i in range(per_shard)]))
    counts = ", ".join(f"{n}: {per_shard}" for n in names)
    totals = f", totals: {{per_shard: {{{counts}}}}}" if declare else ""
    (tmp_path / "c.yaml").write_text(
        f"t: {{description: d, format: webdataset, location: {{root: ., shards: '{{00..{shards - 1:02d}}}.tar'}}{totals}, "
        "loading: {val_batches: 0, image_size: 16, augmentation: none}}\n"
    )
    return datacat.load_catalog([tmp_path / "c.yaml"])


def test_tar_records_are_shuffled_across_shards(tmp_path: Path) -> None:
    catalog = _entry(tmp_path, 8, 25)
    loader = datacat.open("t", framework="torch", batch_size=16, catalog=catalog, seed=3)
    batches = [list(b["key"]) for b in loader]
    assert len({k[:2] for k in batches[0]}) >= 6, batches[0]  # the first batch mixes at least 6 of 8 shards
    keys = [k for b in batches for k in b]
    assert sorted(keys) == sorted(f"{s:02d}{i:03d}" for s in range(8) for i in range(25))
    # A record's position in its shard says nothing of its position in the epoch.
    in_shard = np.array([int(k[2:]) for k in keys])
    in_epoch = np.arange(len(keys))
    rho = np.corrcoef(np.argsort(np.argsort(in_shard)), in_epoch)[0, 1]
    assert abs(rho) < 0.1, rho
    # Any worker count gives the same order (tars are random access now), and a state resumes exactly.
    again = [
        list(b["key"])
        for b in datacat.open("t", framework="torch", batch_size=16, catalog=catalog, seed=3, num_workers=2)
    ]
    assert again == batches
    head = datacat.open("t", framework="torch", batch_size=16, catalog=catalog, seed=3)
    iterator = iter(head)
    first = [list(next(iterator)["key"]) for _ in range(4)]
    state = head.state_dict()
    iterator.close()
    rest = datacat.open("t", framework="torch", batch_size=16, catalog=catalog, seed=3, num_workers=2)
    rest.load_state_dict(state)
    assert first + [list(b["key"]) for b in rest] == batches


def test_tar_index_is_kept_in_the_manifest(tmp_path: Path) -> None:
    from datacat.storage.manifests import load_manifest

    catalog = _entry(tmp_path, 3, 4, declare=False)
    plan = datacat.resolve("t", catalog=catalog)
    assert plan.samples is None and load_manifest(plan.manifest) is None
    assert len([k for b in datacat.open("t", framework="torch", batch_size=4, catalog=catalog) for k in b["key"]]) == 12
    manifest = load_manifest(plan.manifest)
    assert manifest is not None and [f.records for f in manifest.shards.values()] == [4, 4, 4]
    from datacat.formats.webdataset import TarStream
    from datacat.loading.sources import SampleSource

    assert SampleSource(datacat.resolve("t", catalog=catalog)).random_access  # every shard indexed
    assert TarStream(datacat.resolve("t", catalog=catalog, read_ahead="64 KiB")).block_size == 65536
    again = datacat.resolve("t", catalog=catalog)  # counts known now, from the manifest
    assert again.samples == 12 and again.samples_exact
    assert datacat.describe("t", catalog=catalog)["plan"]["samples"] == 12


def _damaged(path: Path, member: int) -> int:
    """Overwrites the header of the ``member``-th file of a tar with noise; returns its byte offset."""
    with tarfile.open(path) as tar:
        offset = tar.getmembers()[member].offset
    data = bytearray(path.read_bytes())
    data[offset : offset + 512] = np.random.default_rng(0).integers(1, 256, 512, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(data))
    return offset


def test_a_damaged_header_mid_shard_is_an_error_naming_the_byte(tmp_path: Path) -> None:
    catalog = _entry(tmp_path, 1, 30, declare=False)
    offset = _damaged(tmp_path / "00.tar", 30)  # sample 15 of 30: tarfile alone would stop there quietly
    with pytest.raises(datacat.ShardError, match=rf"00\.tar is damaged at byte {offset}"):
        datacat.open("t", framework="torch", batch_size=4, catalog=catalog)
    from datacat.formats.tar import group_by_key, tar_members

    with open(tmp_path / "00.tar", "rb") as f, pytest.raises(datacat.ShardError, match=f"damaged at byte {offset}"):
        list(group_by_key(tar_members(f, "00.tar"), "00.tar"))


@pytest.mark.parametrize("cut", ["boundary", "inside"])
def test_a_truncated_shard_is_an_error_not_a_short_shard(tmp_path: Path, cut: str) -> None:
    catalog = _entry(tmp_path, 1, 10, declare=False)
    path = tmp_path / "00.tar"
    with tarfile.open(path) as tar:
        member = tar.getmembers()[12]
    end = member.offset if cut == "boundary" else member.offset_data + 100
    path.write_bytes(path.read_bytes()[:end])
    with pytest.raises(datacat.ShardError, match=r"00\.tar (is truncated|is not a readable tar)"):
        datacat.open("t", framework="torch", batch_size=4, catalog=catalog)


def test_gzipped_tars_are_still_read_shard_by_shard(tmp_path: Path) -> None:
    keys = [f"{i:03d}" for i in range(6)]
    make_tar(tmp_path / "0.tar", sample_members(keys), compress=True)
    (tmp_path / "c.yaml").write_text(
        "z: {description: d, format: webdataset, location: {root: ., shards: 0.tar}, loading: {val_batches: 0, image_size: 16}}\n"
    )
    loader = datacat.open("z", framework="torch", batch_size=4, catalog=datacat.load_catalog([tmp_path / "c.yaml"]))
    assert not loader.source.random_access
    assert sorted(k for b in loader for k in b["key"]) == keys


def test_span_reads_parse_one_sample(tmp_path: Path) -> None:
    from datacat.formats.tar import member_spans, sample_of_span

    path = make_tar(tmp_path / "x.tar", sample_members(["a", "b"]))
    with open(path, "rb") as f:
        spans, compressed = member_spans(f, str(path), seekable=True)
    assert not compressed and len(spans) == 2
    raw = path.read_bytes()
    key, fields = sample_of_span(raw[spans[1][0] : spans[1][1]], str(path), int(spans[1][0]))
    assert key == "b" and set(fields) == {"jpg", "txt"}
    with pytest.raises(datacat.errors.RecordError, match="holds 2 samples"):
        sample_of_span(raw[spans[0][0] : spans[1][1]], str(path), 0)
    stream = io.BytesIO(raw)
    streamed, _ = member_spans(stream, str(path))
    assert (streamed == spans).all()


def test_a_fifo_named_like_a_shard_is_refused_not_waited_on(tmp_path: Path) -> None:
    import os
    import threading

    catalog = _entry(tmp_path, 2, 3, declare=False)
    (tmp_path / "01.tar").unlink()
    os.mkfifo(tmp_path / "01.tar")  # opening it for reading would block until a writer came
    outcome: list[BaseException] = []

    def attempt() -> None:
        try:
            datacat.open("t", framework="torch", batch_size=2, catalog=catalog)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "open() blocked on a FIFO"
    assert isinstance(outcome[0], datacat.ShardError) and "01.tar is not a regular file" in str(outcome[0])


def test_images_over_the_pixel_limit_are_refused_from_their_header(tmp_path: Path) -> None:
    catalog = _entry(tmp_path, 1, 4, declare=False)
    assert datacat.resolve("t", catalog=catalog).loading.max_pixels == 40_000_000
    loader = datacat.open(
        "t", framework="torch", batch_size=4, catalog=catalog, on_bad_sample="skip", bad_sample_budget=1.0
    )
    assert len([k for b in loader for k in b["key"]]) == 4  # 48x40 images: under the default
    small = datacat.resolve("t", catalog=catalog, max_pixels=1000)
    loader = datacat.open(small, framework="torch", batch_size=4, on_bad_sample="skip", bad_sample_budget=1.0)
    assert [k for b in loader for k in b["key"]] == []
    assert all("over the 1000-pixel limit" in bad.reason for bad in loader.ledger.skipped)


def test_a_missing_fsspec_backend_names_what_to_install(monkeypatch) -> None:
    import fsspec

    from datacat.storage import files as storage

    def no_gcsfs(*args, **kwargs):
        raise ImportError("Install gcsfs to access Google Storage", name="gcsfs")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_gcsfs)
    with pytest.raises(datacat.BackendUnavailable, match=r"pip install 'datacat\[gcs\]'"):
        storage.read_bytes("gs://bucket/x.tar")


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_a_span_reads_the_same_with_or_without_tarfile(fmt: int, tmp_path: Path) -> None:
    import io

    from datacat.formats.tar import _plain_members, sample_of_span

    long_name = "a/" + "x" * 120 + "/0001"  # needs a pax or GNU long-name header, or the ustar prefix
    members = [("d/0001.jpg", b"\xff\xd8" * 700), ("d/0001.txt", "légende".encode()), (f"{long_name}.cls", b"3")]
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    data = buffer.getvalue()
    first_two = data[: 512 + 1536 + 512 + 512]  # the .jpg and the .txt, each a header and padded data
    parsed = _plain_members(first_two)
    if fmt == tarfile.PAX_FORMAT and parsed is None:
        pass  # pax headers (for the utf-8 name) go to tarfile: fine, as long as the result agrees
    else:
        assert parsed == members[:2]
    assert sample_of_span(first_two, "x.tar", 0) == ("d/0001", {"jpg": members[0][1], "txt": members[1][1]})
    whole = _plain_members(data.rstrip(b"\0") + b"\0" * (-len(data.rstrip(b"\0")) % 512))
    assert whole is None or whole == members  # a long name is parsed right or left to tarfile, never misread


def test_indexing_a_shard_holds_no_object_per_member(tmp_path: Path) -> None:
    # tarfile keeps every member it reads; the index needs only two int64 per sample. Holding them made
    # RSS follow the dataset (~50 MB more at 100k samples, copied into each forked worker).
    import tracemalloc

    from datacat.formats.tar import member_spans

    path = tmp_path / "big.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(10_000):
            for ext in ("jpg", "txt"):
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
    with path.open("rb") as stream:
        tracemalloc.start()
        try:
            spans, compressed = member_spans(stream, str(path), seekable=True)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert not compressed and spans.shape == (10_000, 2) and spans[1, 0] == spans[0, 1]
    assert peak < 4_000_000, f"indexing 20k members peaked at {peak / 1e6:.1f} MB of Python objects"


@pytest.mark.parametrize("long_name", [False, True])
def test_a_local_shard_indexed_from_its_headers_matches_tarfile(tmp_path: Path, long_name: bool) -> None:
    # Plain ustar headers are read one pread at a time; a header tarfile must read (here a GNU long name)
    # sends the whole shard through tarfile. Either way the spans are tarfile's, byte for byte.
    from datacat.formats.tar import _header_spans, _tarfile_spans, member_spans

    path = tmp_path / "0.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        folder = tarfile.TarInfo("images")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for i in range(6):
            stem = "images/" + ("x" * 120 if long_name and i == 3 else "") + f"{i:04d}"
            for ext, payload in (("jpg", b"j" * (100 + 600 * i)), ("cls.txt", b"%d" % i)):
                info = tarfile.TarInfo(f"{stem}.{ext}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    with path.open("rb") as stream:
        fast = _header_spans(stream, str(path))
        stream.seek(0)
        slow = _tarfile_spans(stream, b"", str(path), seekable=True)
        stream.seek(0)
        spans, _ = member_spans(stream, str(path), seekable=True)
    assert (fast is None) == long_name
    assert spans.tolist() == np.frombuffer(slow.spans, np.int64).reshape(-1, 2).tolist() and len(spans) == 6
    if fast is not None:
        assert list(fast.spans) == list(slow.spans)


def test_indexing_refuses_a_key_that_comes_back_or_a_member_given_twice(tmp_path: Path) -> None:
    from datacat.formats.tar import member_spans

    for name, members, message in (
        ("back.tar", [("a.jpg", b"1"), ("b.jpg", b"2"), ("a.txt", b"3")], r"key 'a' appears again after other keys"),
        ("twice.tar", [("a.jpg", b"1"), ("a.jpg", b"2")], r"key 'a' has member \.jpg twice"),
    ):
        path = make_tar(tmp_path / name, members)
        with path.open("rb") as stream, pytest.raises(datacat.errors.RecordError, match=message):
            member_spans(stream, str(path), seekable=True)


def test_a_header_checksum_is_the_sum_of_its_bytes(tmp_path: Path) -> None:
    from datacat.formats.tar import _checksum

    rng = np.random.default_rng(0)
    headers = [rng.integers(0, 256, 512, dtype=np.uint8).tobytes() for _ in range(200)]
    headers += [b"\xff" * 512, b"\0" * 512]
    path = make_tar(tmp_path / "x.tar", sample_members(["a", "b"]))
    raw = path.read_bytes()
    headers += [raw[at : at + 512] for at in (0, 1024)]  # two real ones, their stored checksum checked too
    for header in headers:
        assert _checksum(header) == sum(header[:148]) + 8 * 32 + sum(header[156:])
    assert _checksum(raw[:512]) == int(raw[148:156].strip(b" \0"), 8)


def test_a_span_hands_its_members_on_as_views_not_copies(tmp_path: Path) -> None:
    from datacat.formats.tar import member_spans, sample_of_span

    path = make_tar(tmp_path / "x.tar", sample_members(["a"]))
    with open(path, "rb") as f:
        ((start, end),), _ = member_spans(f, str(path), seekable=True)
    span = path.read_bytes()[start:end]
    _, fields = sample_of_span(span, str(path), int(start))
    assert isinstance(fields["jpg"], memoryview) and fields["jpg"].obj is span
    loader = datacat.open("t", framework="torch", batch_size=3, catalog=_entry(tmp_path, 1, 3), num_workers=0)
    (batch,) = list(loader)  # the views decode, and their captions read, as bytes did
    assert batch["image"].shape == (3, 16, 16, 3) and all(isinstance(c, str) and c for c in batch["caption"])


def test_local_shards_stay_open_between_reads_but_a_replaced_or_deleted_one_is_seen(tmp_path: Path) -> None:
    import os

    from datacat.storage import files as storage

    files = storage._OpenFiles(limit=4)
    first, second = tmp_path / "a.bin", tmp_path / "b.bin"
    first.write_bytes(b"old contents")
    taken = files.take(str(first))
    files.give(taken)
    assert files.take(str(first)) is taken  # the same open file, no new open
    files.give(taken)
    second.write_bytes(b"new contents")
    os.replace(second, first)  # a writer's atomic replace: a new file under the old name
    again = files.take(str(first))
    assert again is not taken and os.pread(again.fd, 3, 0) == b"new"
    files.give(again)
    assert taken.retired and len(files._open) == 1  # the replaced file's fd was closed (its number may be reused)
    first.unlink()
    with pytest.raises(FileNotFoundError, match=r"shard not found: .*a\.bin"):
        files.take(str(first))


def test_at_most_the_limit_of_local_shards_stay_open(tmp_path: Path) -> None:
    import os

    from datacat.storage import files as storage

    files = storage._OpenFiles(limit=4)
    before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        (tmp_path / f"{i}.bin").write_bytes(b"x" * 10)
        files.give(files.take(str(tmp_path / f"{i}.bin")))
    assert len(os.listdir("/proc/self/fd")) - before == 4
    held = files.take(str(tmp_path / "0.bin"))  # a file being read is closed only once its reader is done
    for i in range(1, 9):
        files.give(files.take(str(tmp_path / f"{i}.bin")))
    assert os.pread(held.fd, 1, 0) == b"x"
    files.give(held)
    assert len(os.listdir("/proc/self/fd")) - before == 4


def test_a_child_forked_while_a_read_held_the_open_files_lock_still_reads(tmp_path: Path) -> None:
    import subprocess
    import sys

    path = tmp_path / "a.bin"
    path.write_bytes(b"abc")
    # In a fresh interpreter: forking this one, where jax may run, would only test jax's fork warning.
    code = f"""
import os, sys, time
from datacat.storage import files as storage
path = {str(path)!r}
assert storage.read_ranges([(path, 0, 3)]) == [b"abc"]  # open in this process
with storage._OPEN_FILES._lock:  # another thread is inside take() as the child is forked
    pid = os.fork()
    if pid == 0:  # the child: a read must not wait for a lock no thread of its own holds
        os._exit(0 if storage.read_ranges([(path, 1, 3)]) == [b"bc"] else 1)
deadline = time.monotonic() + 20
while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
if done[0] == 0:
    os.kill(pid, 9)
    sys.exit("the forked child hung on the open-files lock")
sys.exit(os.waitstatus_to_exitcode(done[1]))
"""
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert finished.returncode == 0, finished.stderr[-2000:]


def test_one_read_of_many_local_ranges_opens_each_file_once_and_keeps_the_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from datacat.errors import ShardError
    from datacat.storage import files as storage

    a, b, gone = tmp_path / "a.bin", tmp_path / "b.bin", tmp_path / "gone.bin"
    a.write_bytes(b"abcdef")
    b.write_bytes(b"uvwxyz")
    looked_up: list[str] = []
    real = storage._local_stat
    monkeypatch.setattr(storage, "_local_stat", lambda url: looked_up.append(url) or real(url))
    out = storage.read_ranges([(str(a), 0, 2), (str(b), 1, 3), (str(gone), 0, 1), (str(a), 4, None), (str(b), 5, 9)])
    assert out[:2] == [b"ab", b"vw"] and out[3] == b"ef"
    assert isinstance(out[2], FileNotFoundError) and str(gone) in str(out[2])
    assert isinstance(out[4], ShardError) and "ends before byte 9" in str(out[4])
    assert sorted(looked_up) == sorted([str(a), str(b), str(gone)])  # one stat a file, not one a range
