"""Text-to-image conditioning: record fields from members and img2dataset's parquet, SDXL size and crop conditioning.

The set is laid out as img2dataset writes it, made here: per shard a tar of
jpg/txt/json samples, a parquet with a row per url tried (some failed, with
no sample in the tar) and LAION's score columns, and a ``_stats.json``.
Images have uneven aspect ratios and a short side under twice the training
size, so they are decoded at full size and the crop can be recomputed from
the stored image exactly.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_tar
from PIL import Image

import datacat
from datacat.errors import CatalogError, ShardError

SHARDS, URLS = 3, 10  # urls tried per shard; every fourth failed
SIZE = 32
SHAPES = [(96, 48), (48, 80), (60, 60), (120, 50), (50, 44), (44, 90)]  # (width, height)


def _photo(seed: int, width: int, height: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((width, height))
    out = io.BytesIO()
    pixels.save(out, "JPEG", quality=95)
    return out.getvalue()


def _img2dataset_folder(folder: Path) -> dict[str, dict[str, Any]]:
    """The folder img2dataset would write; returns each successful sample's metadata row by key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows: dict[str, dict[str, Any]] = {}
    for shard in range(SHARDS):
        members, table = [], []
        for i in range(URLS):
            key = f"{shard:05d}{i:04d}"
            width, height = SHAPES[(shard * URLS + i) % len(SHAPES)]
            ok = i % 4 != 3
            row = {
                "key": key,
                "url": f"https://example.com/{key}.jpg",
                "caption": f"a photo numbered {key}",
                "status": "success" if ok else "failed_to_download",
                "width": width if ok else None,
                "height": height if ok else None,
                "aesthetic": round(4.0 + (shard * URLS + i) / 10, 2),
                "punsafe": round(i / 100, 3),
            }
            table.append(row)
            if ok:
                meta = {k: row[k] for k in ("url", "caption", "key", "status", "width", "height")}
                meta |= {"original_width": width * 3, "original_height": height * 3, "exif": "{}"}
                members += [
                    (f"{key}.jpg", _photo(shard * URLS + i, width, height)),
                    (f"{key}.txt", str(row["caption"]).encode()),
                    (f"{key}.json", json.dumps(meta).encode()),
                    (f"{key}.bin", key.encode()[::-1]),  # a member of no known type: its bytes
                ]
                rows[key] = {**row, "json": meta}
        make_tar(folder / f"{shard:05d}.tar", members)
        pq.write_table(pa.Table.from_pylist(table), folder / f"{shard:05d}.parquet")
        successes = sum(r["status"] == "success" for r in table)
        stats = {"count": URLS, "successes": successes, "failed_to_download": URLS - successes}
        (folder / f"{shard:05d}_stats.json").write_text(json.dumps(stats))
    return rows


@pytest.fixture(scope="module")
def laion(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("img2dataset")
    rows = _img2dataset_folder(folder)
    catalog = folder / "catalog.yaml"
    location = f"location: {{root: '{folder}', shards: '{{00000..{SHARDS - 1:05d}}}.tar'}}"
    fields = "[json, aesthetic, punsafe, width, url]"
    catalog.write_text(
        f"laion: {{description: d, format: webdataset, {location}, record: {{fields: {fields}, metadata: parquet}}, "
        f"loading: {{image_size: {SIZE}, val_batches: 0, augmentation: none}}}}\n"
        f"sized: {{description: d, format: webdataset, {location}, "
        f"loading: {{image_size: {SIZE}, val_batches: 0, augmentation: flip_only, size_conditioning: true}}}}\n"
        f"members: {{description: d, format: webdataset, {location}, record: {{fields: [json, bin]}}, "
        f"loading: {{image_size: {SIZE}, val_batches: 0}}}}\n"
        f"chosen: {{description: d, format: webdataset, {location}, record: {{metadata: parquet, fields: [aesthetic]}}, "
        f"select: {{aesthetic: {{'>=': 4.5}}, punsafe: {{'<': 0.08}}}}, loading: {{image_size: {SIZE}, val_batches: 0}}}}\n"
        f"others: {{description: d, format: webdataset, {location}, record: {{metadata: parquet}}, "
        f"select: {{aesthetic: {{'<': 4.5}}}}, loading: {{image_size: {SIZE}, val_batches: 0}}}}\n"
        "both: {description: d, format: mixture, mixture: {components: [{name: chosen, weight: 3}, {name: others, weight: 1}], "
        "exhaustion: restart}}\n"
        f"bucketed: {{description: d, format: webdataset, {location}, record: {{metadata: parquet}}, "
        f"loading: {{image_size: {SIZE}, val_batches: 0, augmentation: flip_only, size_conditioning: true, "
        "buckets: {sizes: [[32, 32], [24, 48], [48, 24]]}}}\n"
        f"misbound: {{description: d, format: webdataset, {location}, record: {{metadata: parquet}}, "
        f"select: {{aesthetics: {{'>=': 5}}}}, loading: {{image_size: {SIZE}, val_batches: 0}}}}\n"
        f"wrong: {{description: d, format: webdataset, {location}, record: {{fields: [aesthetics], metadata: parquet}}, "
        f"loading: {{image_size: {SIZE}, val_batches: 0, on_bad_sample: raise}}}}\n"
    )
    return catalog, rows


def _batches(name: str, catalog: Path, framework: str, **options: Any) -> list[dict[str, Any]]:
    loader = datacat.open(
        name, framework=framework, batch_size=4, catalog=datacat.load_catalog([catalog]), seed=3, **options
    )
    return [dict(batch) for batch in loader]


@pytest.mark.parametrize(("framework", "workers"), [("torch", 0), ("torch", 2), ("jax", 0)])
def test_fields_are_the_members_and_the_table_rows(
    laion: tuple[Path, dict[str, dict[str, Any]]], framework: str, workers: int
) -> None:
    catalog, rows = laion
    seen = []
    for batch in _batches("laion", catalog, framework, num_workers=workers):
        assert isinstance(batch["json"], list) and isinstance(batch["url"], list)
        aesthetic, punsafe, width = (np.asarray(batch[k]) for k in ("aesthetic", "punsafe", "width"))
        assert aesthetic.dtype == np.float64 and width.dtype == np.int64 and aesthetic.shape == (len(batch["key"]),)
        for i, key in enumerate(batch["key"]):
            row = rows[key]
            assert batch["json"][i] == row["json"]  # the member, parsed
            assert batch["url"][i] == row["url"] and width[i] == row["width"]  # the parquet's columns
            assert aesthetic[i] == row["aesthetic"] and punsafe[i] == row["punsafe"]
            seen.append(key)
    assert sorted(seen) == sorted(rows)  # every success once; the failed urls' rows meet no sample


def test_torch_and_jax_give_the_same_fields(laion: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    catalog, _ = laion
    torch_batches = _batches("laion", catalog, "torch")
    jax_batches = _batches("laion", catalog, "jax")
    for one, other in zip(torch_batches, jax_batches, strict=True):
        assert one["key"] == other["key"] and one["json"] == other["json"]
        assert np.array_equal(np.asarray(one["aesthetic"]), np.asarray(other["aesthetic"]))


def test_size_and_crop_conditioning_is_the_crop_taken(laion: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    from datacat.transforms.resize import resize_image

    catalog, _ = laion
    folder = catalog.parent
    stored: dict[str, np.ndarray] = {}
    for shard in range(SHARDS):
        import tarfile

        with tarfile.open(folder / f"{shard:05d}.tar") as tar:
            for member in tar.getmembers():
                if member.name.endswith(".jpg"):
                    data = tar.extractfile(member).read()  # type: ignore[union-attr]
                    stored[member.name[:-4]] = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    flips = {True: 0, False: 0}
    for batch in _batches("sized", catalog, "torch"):
        original, crop, target = (np.asarray(batch[k]) for k in ("original_size", "crop_top_left", "target_size"))
        assert original.dtype == np.int64 and original.shape == (len(batch["key"]), 2)
        for i, key in enumerate(batch["key"]):
            image = stored[key]
            height, width = image.shape[:2]
            side = min(height, width)
            top, left = (height - side) // 2, (width - side) // 2
            assert tuple(original[i]) == (height, width) and tuple(target[i]) == (SIZE, SIZE)
            plain = resize_image(image, SIZE)
            got = np.asarray(batch["image"][i])
            flipped = not np.array_equal(got, plain)
            if flipped:
                assert np.array_equal(got, plain[:, ::-1])
            flips[flipped] += 1
            y, x = crop[i]
            # The crop's top-left in the image as the model saw it: the flipped image when the sample was flipped.
            seen = image[:, ::-1] if flipped else image
            assert (y, x) == (top, width - left - side if flipped else left)
            assert np.array_equal(
                seen[y : y + side, x : x + side],
                image[top : top + side, left : left + side][:, ::-1]
                if flipped
                else image[top : top + side, left : left + side],
            )
    assert flips[True] and flips[False]  # both cases were met


def test_a_field_found_nowhere_names_the_table_and_the_fix(laion: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    catalog, _ = laion
    with pytest.raises(ShardError, match=r"no member \.aesthetics, and .*00000\.parquet has no column 'aesthetics'"):
        _batches("wrong", catalog, "torch")  # at open, before any batch
    with pytest.raises(ShardError, match=r"select bounds 'aesthetics', which .*00000\.parquet has no column of"):
        _batches("misbound", catalog, "torch")
    batch = _batches("members", catalog, "torch", num_workers=2)[0]  # members only: no table needed
    assert all(isinstance(meta, dict) and meta["status"] == "success" for meta in batch["json"])
    assert batch["bin"] == [key.encode()[::-1] for key in batch["key"]]


def test_fields_are_validated_with_the_entry(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "a: {description: d, format: webdataset, location: {root: /x, shards: '0.tar'}, record: {fields: [key]}}\n"
        "b: {description: d, format: image_folder, location: {root: /x, shards: '*'}, record: {fields: [json]}}\n"
        "c: {description: d, format: array_record, location: {root: /x, shards: '0.ar'}, record: {metadata: parquet}}\n"
        "e: {description: d, format: webdataset, location: {root: /x, shards: '0.tar'}, select: {w: {'>=': 1}}}\n"
        "f: {description: d, format: webdataset, location: {root: /x, shards: '0.tar'}, record: {metadata: parquet}, "
        "select: {w: {'=>': 1}}}\n"
    )
    with pytest.raises(CatalogError) as caught:
        datacat.load_catalog([path])
    text = str(caught.value)
    assert "'key': datacat fills that batch key itself" in text
    assert "does not pass record fields through" in text
    assert "joins none, not 'parquet'" in text
    assert "set record.metadata (parquet) to say which table holds them" in text
    assert "=>" in text and "select" in text


def test_counts_come_from_the_stats_files_with_no_shard_opened(
    laion: tuple[Path, dict[str, dict[str, Any]]], tmp_path: Path
) -> None:
    catalog, rows = laion
    for stats in catalog.parent.glob("*_stats.json"):  # the stats alone: a shard read would fail
        (tmp_path / stats.name).write_bytes(stats.read_bytes())
    alone = tmp_path / "catalog.yaml"
    alone.write_text(catalog.read_text().replace(str(catalog.parent), str(tmp_path)))
    plan = datacat.resolve("laion", catalog=datacat.load_catalog([alone]))
    successes = [sum(key.startswith(f"{s:05d}") for key in rows) for s in range(SHARDS)]
    assert [s.samples for s in plan.shards] == successes and plan.samples == len(rows) and plan.samples_exact
    described = datacat.describe("laion", catalog=datacat.load_catalog([alone]))
    assert described["plan"]["samples"] == len(rows)
    (tmp_path / "00001_stats.json").write_text('{"count": 10}')
    with pytest.raises(ShardError, match=r"00001_stats\.json is not img2dataset's stats of 00001\.tar"):
        datacat.resolve("laion", catalog=datacat.load_catalog([alone]))


def _chosen(rows: dict[str, dict[str, Any]]) -> list[str]:
    return sorted(k for k, r in rows.items() if r["aesthetic"] >= 4.5 and r["punsafe"] < 0.08)


def test_select_reads_exactly_the_matching_records_once_over_ranks_and_workers(
    laion: tuple[Path, dict[str, dict[str, Any]]],
) -> None:
    catalog, rows = laion
    expected = _chosen(rows)
    assert 0 < len(expected) < len(rows)
    keys: list[str] = []
    for rank in range(4):
        for batch in _batches("chosen", catalog, "torch", num_workers=2, world_size=4, rank=rank, epochs=1):
            assert all(a >= 4.5 for a in np.asarray(batch["aesthetic"]))
            keys += batch["key"]
    assert sorted(keys) == expected  # each matching record once, no other
    text = subprocess.run(
        [sys.executable, "-m", "datacat", "describe", "chosen"],
        env={**os.environ, "DATACAT_CATALOG": str(catalog)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"select: aesthetic >= 4.5, punsafe < 0.08: {len(expected)} records" in text


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_selected_epoch_resumes_exactly(laion: tuple[Path, dict[str, dict[str, Any]]], framework: str) -> None:
    catalog, rows = laion
    options: dict[str, Any] = {"batch_size": 2, "seed": 4, "catalog": datacat.load_catalog([catalog]), "epochs": 2}
    full = [list(b["key"]) for b in datacat.open("chosen", framework=framework, **options)]
    assert sorted(k for b in full[: len(full) // 2] for k in b) == _chosen(rows)  # epoch 1: the selection
    loader = datacat.open("chosen", framework=framework, **options)
    batches = iter(loader)
    head = [list(next(batches)["key"]) for _ in range(5)]
    state = loader.state_dict()
    loader.close()
    again = datacat.open("chosen", framework=framework, **options)
    again.load_state_dict(state)
    assert head + [list(b["key"]) for b in again] == full


def test_a_mixture_of_selections_holds_its_weights(laion: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    catalog, rows = laion
    chosen, others = set(_chosen(rows)), {k for k, r in rows.items() if r["aesthetic"] < 4.5}
    catalog_ = datacat.load_catalog([catalog])
    loader = datacat.open("both", framework="torch", batch_size=8, catalog=catalog_, seed=1, epochs=None)
    keys = [k for batch, _ in zip(loader, range(40), strict=False) for k in batch["key"]]
    assert set(keys) <= chosen | others and chosen <= set(keys) and others <= set(keys)
    share = sum(k in chosen for k in keys) / len(keys)
    assert 0.68 < share < 0.82, share  # weights 3 : 1 over 320 draws


BUCKETS = [(32, 32), (24, 48), (48, 24)]


def _nearest(height: int, width: int) -> tuple[int, int]:
    return min(BUCKETS, key=lambda b: abs(np.log(width / height) - np.log(b[1] / b[0])))


def _stored_sizes(rows: dict[str, dict[str, Any]]) -> dict[str, tuple[int, int]]:
    return {key: (row["height"], row["width"]) for key, row in rows.items()}


@pytest.mark.parametrize(("framework", "workers"), [("torch", 2), ("jax", 2)])
def test_a_bucketed_epoch_gives_batches_of_one_bucket_each_record_once(
    laion: tuple[Path, dict[str, dict[str, Any]]], framework: str, workers: int
) -> None:
    catalog, rows = laion
    stored = _stored_sizes(rows)
    keys: list[str] = []
    shapes = set()
    for batch in _batches("bucketed", catalog, framework, num_workers=workers):
        image = np.asarray(batch["image"])
        bucket = image.shape[1:3]
        assert bucket in BUCKETS and all(_nearest(*stored[k]) == bucket for k in batch["key"])
        assert all(tuple(t) == bucket for t in np.asarray(batch["target_size"]))
        assert all(tuple(o) == stored[k] for o, k in zip(np.asarray(batch["original_size"]), batch["key"], strict=True))
        shapes.add(bucket)
        keys += batch["key"]
    assert sorted(keys) == sorted(rows) and shapes == set(BUCKETS)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_bucketed_epoch_over_ranks_resumes_exactly(
    laion: tuple[Path, dict[str, dict[str, Any]]], framework: str
) -> None:
    catalog, rows = laion
    options: dict[str, Any] = {"batch_size": 2, "seed": 6, "catalog": datacat.load_catalog([catalog]), "epochs": 2}
    keys: list[str] = []
    for rank in range(2):
        for batch in datacat.open(
            "bucketed",
            framework=framework,
            world_size=2,
            rank=rank,
            epochs=1,
            **{k: v for k, v in options.items() if k != "epochs"},
        ):
            keys += batch["key"]
    assert sorted(keys) == sorted(rows)  # every record once over both ranks
    full = [list(b["key"]) for b in datacat.open("bucketed", framework=framework, **options)]
    loader = datacat.open("bucketed", framework=framework, **options)
    batches = iter(loader)
    head = [list(next(batches)["key"]) for _ in range(4)]
    state = loader.state_dict()
    again = datacat.open("bucketed", framework=framework, **options)
    again.load_state_dict(state)
    assert head + [list(b["key"]) for b in again] == full
    other = datacat.open("bucketed", framework=framework, **{**options, "batch_size": 3})
    with pytest.raises(datacat.errors.PlanMismatch, match="aspect-ratio buckets"):
        other.load_state_dict(state)


def test_jax_compiles_a_step_once_per_bucket(laion: tuple[Path, dict[str, dict[str, Any]]]) -> None:
    import jax
    import jax.numpy as jnp

    catalog, _ = laion
    traced: list[tuple[int, ...]] = []

    @jax.jit
    def step(images: jax.Array) -> jax.Array:
        traced.append(images.shape)  # runs when jax traces, once a shape
        return jnp.mean(images.astype(jnp.float32))

    loader = datacat.open(
        "bucketed",
        framework="jax",
        batch_size=2,
        drop_remainder=True,
        catalog=datacat.load_catalog([catalog]),
        epochs=2,
    )
    seen = []
    for batch in loader:
        step(batch["image"]).block_until_ready()
        seen.append(batch["image"].shape)
    assert len(seen) > len(BUCKETS) and len(traced) == len(set(seen)) == len(BUCKETS)


def test_verify_builds_the_selection_for_every_loader(
    laion: tuple[Path, dict[str, dict[str, Any]]], tmp_path: Path
) -> None:
    catalog, rows = laion
    env = {**os.environ, "DATACAT_CATALOG": str(catalog), "DATACAT_CACHE": str(tmp_path / "fresh-cache")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "datacat", *args], env=env, capture_output=True, text=True)

    assert "counted when a loader first opens it" in cli("describe", "chosen").stdout
    verified = cli("verify", "chosen")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"select keeps {len(_chosen(rows))} of {len(rows)} records" in verified.stdout
    assert "not a shard the entry names" not in verified.stdout  # the tables and stats beside the tars
    assert f"{len(_chosen(rows))} records" in cli("describe", "chosen").stdout
