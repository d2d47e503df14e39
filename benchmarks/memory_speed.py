"""Decoded pixels and embedding rows against one core's memcpy of the same bytes, and the first batch after open.

    python benchmarks/memory_speed.py [--images 1000] [--rows 200000] [--rounds 3] [--workers 2] [--run 64]

Pixels: the benchmarks' photo corpus (corpus.py) converted as a user would,
``datacat convert --layout pre_resized`` (256x256x3 uint8, one record a
chunk, uncompressed). Embeddings: an embedding table as clip-retrieval
writes it (``img_emb``/``text_emb`` float16 [rows, 768] ``.npy`` files and
``metadata`` parquet captions, 10 shards). Every contender runs in a
process of its own, rounds alternating, each over the same files (in the
page cache: the first epoch warms it):

    memcpy            one core's ``np.copyto`` of the same bytes, source and destination
                      each as large as the whole set (so neither stays in the CPU's cache)
    array_record      pixels: array_record's own reader, ``read(indices)`` of shuffled
                      batches, each record's image entry stacked with numpy (one process)
    numpy memmap      embeddings: ``np.memmap`` of each table, shuffled batches gathered
                      by fancy indexing, a gather per shard, float16 as stored (one process);
                      and with runs of ``--run`` rows shuffled together, a slice copy a run
    numpy take        embeddings: the machine's own rate for scattered rows, each table whole
                      in memory, ``np.take`` of shuffled batches straight into the batch, two
                      threads side by side (what no loader of scattered rows can beat)
    datacat           torch and jax (grain), with ``--workers`` worker processes and with
                      none; batches of 64 images or 1024 rows; shuffled record by record,
                      and with ``shuffle_run=--run`` (neighbours moved together)

Steady rate: samples a second from the end of a loader's first epoch to the
end of its fourth (start-up and the first epoch's page faults excluded).
First batch: seconds from ``datacat.open`` to the first batch, the framework
already imported (a training script imports it before it opens data).
Ratios are each contender's steady rate over memcpy's of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import JSON, median_spread, spread, write_results

SIZE = 256
DIM = 768
TABLE_SHARDS = 10
EPOCHS = 4


def _pixels_set(folder: Path, images: int) -> Path:
    """The corpus, converted to pre-resized shards by ``datacat convert``; the catalog naming ``px``."""
    from corpus import build_corpus, write_catalog

    out = folder / "pre_resized"
    catalog = out / "px.yaml"  # the entry convert wrote, with colour jitter off (it is compute, not memory)
    if catalog.exists():
        return catalog
    per_shard = build_corpus(folder / "corpus", images, 4)
    source = write_catalog(folder / "corpus", per_shard)
    subprocess.run(
        [sys.executable, "-m", "datacat", "--catalog", str(source), "convert", "bench-ar", "--out", str(out),
         "--layout", "pre_resized", "--records-per-shard", str(images // 4), "--entry-name", "px"],
        check=True,
    )  # fmt: skip
    written = (out / "catalog.yaml").read_text()
    catalog.write_text(written.replace("    val_batches: 0\n", "    val_batches: 0\n    augmentation: none\n"))
    return catalog


def _table_set(folder: Path, rows: int) -> Path:
    """An embedding table of ``rows`` rows (float16 image and text embeddings, captions); the catalog naming ``emb``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    catalog = folder / "emb.yaml"
    if catalog.exists():
        return catalog
    rng = np.random.default_rng(0)
    for sub in ("img_emb", "text_emb", "metadata"):
        (folder / "table" / sub).mkdir(parents=True, exist_ok=True)
    per = rows // TABLE_SHARDS
    for shard in range(TABLE_SHARDS):
        for sub in ("img_emb", "text_emb"):
            array = rng.standard_normal((per, DIM), dtype=np.float32).astype(np.float16)
            np.save(folder / "table" / sub / f"{sub}_{shard:04d}.npy", array)
        captions = pa.table({"caption": [f"a caption of row {shard}:{i}" for i in range(per)]})
        pq.write_table(captions, folder / "table" / "metadata" / f"metadata_{shard:04d}.parquet")
    catalog.write_text(
        f"emb:\n  description: benchmark embedding table\n  format: embedding_table\n"
        f"  location: {{root: {folder / 'table'}, shards: '{{0000..{TABLE_SHARDS - 1:04d}}}'}}\n"
        f"  prior: {{dim: {DIM}}}\n"
    )
    return catalog


def _shards(catalog: Path, name: str) -> list[str]:
    import datacat

    return [shard.url for shard in datacat.resolve(name, catalog=datacat.load_catalog(catalog)).shards]


def run_memcpy(nbytes: int, item_bytes: int) -> dict[str, float]:
    """One core's copy of ``nbytes`` between two arrays as large: items a second."""
    source = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    target = np.empty_like(source)
    np.copyto(target, source)  # pages faulted in
    times = []
    for _ in range(5):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return {"rate": nbytes / item_bytes / float(np.median(times))}


def run_array_record(catalog: Path, batch: int) -> dict[str, float]:
    """array_record's reader over the pre-resized shards: shuffled batches read at once, images stacked."""
    from array_record.python import array_record_module

    readers = [array_record_module.ArrayRecordReader(url, "readahead_buffer_size:0") for url in _shards(catalog, "px")]
    counts = [r.num_records() for r in readers]
    where = [(s, i) for s, n in enumerate(counts) for i in range(n)]
    head = 4 + 5 + 4  # the packed record's first entry header: 'image' comes first
    pixels = SIZE * SIZE * 3

    def epoch(seed: int) -> int:
        order = np.random.default_rng(seed).permutation(len(where))
        done = 0
        for start in range(0, len(order), batch):
            chosen = [where[i] for i in order[start : start + batch]]
            records: list[bytes] = []
            for s in sorted({s for s, _ in chosen}):
                records += readers[s].read([i for t, i in chosen if t == s])
            stacked = np.stack([np.frombuffer(r, np.uint8, pixels, head) for r in records])
            done += len(stacked)
        return done

    epoch(0)
    start = time.perf_counter()
    n = sum(epoch(e) for e in range(1, EPOCHS))
    return {"rate": n / (time.perf_counter() - start)}


def run_memmap(catalog: Path, batch: int, run: int = 1) -> dict[str, float]:
    """numpy over the tables: each batch's rows gathered from the memory maps (float16, as stored).

    With ``run`` > 1 the shuffle moves runs of ``run`` neighbouring rows and each run is one slice copy.
    """
    import datacat

    plan = datacat.resolve("emb", catalog=datacat.load_catalog(catalog))
    root = Path(plan.root)
    maps = [
        [np.load(root / sub / f"{sub}_{s.name}.npy", mmap_mode="r") for s in plan.shards]
        for sub in ("img_emb", "text_emb")
    ]
    per = len(maps[0][0])
    total = per * len(plan.shards)

    def epoch(seed: int) -> int:
        if run > 1:  # each shard's whole runs, shuffled
            runs = per // run
            starts = np.random.default_rng(seed).permutation(runs * len(plan.shards))
            done = 0
            for first in range(0, len(starts), batch // run):
                chosen = starts[first : first + batch // run]
                for tables in maps:
                    out = np.empty((len(chosen) * run, DIM), np.float16)
                    for k, begin in enumerate(chosen.tolist()):
                        s, row = divmod(begin, runs)
                        out[k * run : (k + 1) * run] = tables[s][row * run : (row + 1) * run]
                done += len(chosen) * run
            return done
        order = np.random.default_rng(seed).permutation(total)
        done = 0
        for start in range(0, total, batch):
            chosen = order[start : start + batch]
            shard, row = chosen // per, chosen % per
            for tables in maps:
                out = np.empty((len(chosen), DIM), np.float16)
                for s in np.unique(shard):
                    picked = shard == s
                    out[picked] = tables[s][row[picked]]
            done += len(chosen)
        return done

    epoch(0)
    start = time.perf_counter()
    n = sum(epoch(e) for e in range(1, EPOCHS))
    return {"rate": n / (time.perf_counter() - start)}


def run_take(catalog: Path, batch: int, threads: int = 2) -> dict[str, float]:
    """The machine's own rate for scattered rows: each table whole in memory, ``np.take`` of shuffled batches
    straight into the batch (no Python a row, no temporary), in ``threads`` threads side by side.
    """
    import concurrent.futures

    import datacat

    plan = datacat.resolve("emb", catalog=datacat.load_catalog(catalog))
    root = Path(plan.root)
    tables = [np.concatenate([np.load(root / sub / f"{sub}_{s.name}.npy") for s in plan.shards])
              for sub in ("img_emb", "text_emb")]  # fmt: skip
    total = len(tables[0])

    def part(seed: int, first: int) -> int:
        order = np.random.default_rng(seed).permutation(total)
        outs = [np.empty((batch, DIM), np.float16) for _ in tables]
        done = 0
        for start in range(first * batch, total - batch + 1, threads * batch):
            for table, out in zip(tables, outs, strict=True):
                np.take(table, order[start : start + batch], axis=0, out=out)
            done += batch
        return done

    def epoch(seed: int, pool: concurrent.futures.ThreadPoolExecutor) -> int:
        return sum(pool.map(part, [seed] * threads, range(threads)))

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        epoch(0, pool)
        start = time.perf_counter()
        n = sum(epoch(e, pool) for e in range(1, EPOCHS))
        return {"rate": n / (time.perf_counter() - start)}


def run_datacat(catalog: Path, name: str, framework: str, workers: int, batch: int, run: int) -> dict[str, float]:
    """datacat's loader: the first batch after open, and the steady rate from the end of epoch 1 to epoch 4."""
    import datacat

    if framework == "torch":
        import torch  # noqa: F401 - imported before open, as a training script does
    else:
        import jax  # noqa: F401

    opened = time.perf_counter()
    loader = datacat.open(
        name, catalog=datacat.load_catalog(catalog), framework=framework, batch_size=batch, num_workers=workers,
        epochs=EPOCHS, drop_remainder=True, shuffle_run=run,
    )  # fmt: skip
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - opened
    per_epoch = len(loader)
    key = "image" if name == "px" else "image_embedding"
    count, start = 0, 0.0
    for i, out in enumerate(batches, start=1):
        _ = out[key]
        if i == per_epoch:
            start, count = time.perf_counter(), 0
        elif i > per_epoch:
            count += len(out["key"])
    rate = count / (time.perf_counter() - start)
    loader.close()
    return {"rate": rate, "first_batch_s": first}


def child(spec: dict[str, Any]) -> dict[str, float]:
    kind = spec["kind"]
    if kind == "memcpy":
        return run_memcpy(spec["nbytes"], spec["item_bytes"])
    if kind == "array_record":
        return run_array_record(Path(spec["catalog"]), spec["batch"])
    if kind == "take":
        return run_take(Path(spec["catalog"]), spec["batch"])
    if kind == "memmap":
        return run_memmap(Path(spec["catalog"]), spec["batch"], spec.get("run", 1))
    return run_datacat(
        Path(spec["catalog"]), spec["name"], spec["framework"], spec["workers"], spec["batch"], spec["run"]
    )


def _in_child(spec: dict[str, Any]) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return {"rate": float("nan"), "first_batch_s": float("nan")}
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--run", type=int, default=64, help="shuffle_run of the run-order contenders")
    parser.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "datacat-memory-speed")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    args.data.mkdir(parents=True, exist_ok=True)
    px, emb = _pixels_set(args.data, args.images), _table_set(args.data, args.rows)
    pixel_bytes, row_bytes = SIZE * SIZE * 3, 2 * DIM * 2  # an image; a row's image and text embeddings
    sets = {
        "pixels": (px, "px", 64, {"kind": "memcpy", "nbytes": args.images * pixel_bytes, "item_bytes": pixel_bytes},
                   {"plain": ({"kind": "array_record", "catalog": str(px), "batch": 64}, "array_record read(batch)")}),
        "embeddings": (emb, "emb", 1024, {"kind": "memcpy", "nbytes": args.rows * row_bytes, "item_bytes": row_bytes},
                       {"plain": ({"kind": "memmap", "catalog": str(emb), "batch": 1024}, "numpy memmap gather"),
                        "take in memory": ({"kind": "take", "catalog": str(emb), "batch": 1024},
                                           "numpy take, tables in memory, 2 threads"),
                        f"plain run={args.run}": ({"kind": "memmap", "catalog": str(emb), "batch": 1024, "run": args.run},
                                                  f"numpy memmap, runs of {args.run}")}),
    }  # fmt: skip
    loaders = [("torch", args.workers, 1), ("torch", 0, 1), ("jax", args.workers, 1), ("jax", 0, 1),
               ("torch", 0, args.run), ("jax", 0, args.run)]  # fmt: skip

    def contenders(set_name: str) -> dict[str, tuple[dict[str, Any], str]]:
        """label -> (the child's spec, the table's name), memcpy excepted."""
        catalog, name, batch, _, plain = sets[set_name]
        out = dict(plain)
        for fw, w, run in loaders:
            label = f"datacat {fw} w={w}" + (f" run={run}" if run > 1 else "")
            shown = f"datacat {fw}, {w} workers" + (f", shuffle_run={run}" if run > 1 else "")
            out[label] = ({"catalog": str(catalog), "name": name, "framework": fw, "workers": w, "batch": batch,
                           "run": run, "kind": "datacat"}, shown)  # fmt: skip
        return out

    figures: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for set_name, (_, _, _, memcpy, _) in sets.items():
            specs = {"memcpy": memcpy} | {label: spec for label, (spec, _) in contenders(set_name).items()}
            for label, spec in specs.items():
                result = _in_child(spec)
                for figure, value in result.items():
                    figures.setdefault(f"{set_name}/{label}/{figure}", []).append(value)
            print(f"round {round_ + 1}/{args.rounds} {set_name} done", file=sys.stderr)
    out: dict[str, JSON] = {key: spread(values) for key, values in figures.items()}
    tables = {}
    for set_name, (_, _, batch, _, _) in sets.items():  # each contender over memcpy, round by round
        base = figures[f"{set_name}/memcpy/rate"]
        unit = "img/s" if set_name == "pixels" else "rows/s"
        rows = [["contender", f"steady {unit}", "of memcpy", "first batch s"]]
        rows.append(["memcpy (one core)", median_spread(base), "1", ""])
        for label, (_, shown) in contenders(set_name).items():
            rates = figures[f"{set_name}/{label}/rate"]
            ratios = [r / b for r, b in zip(rates, base, strict=True)]
            out[f"{set_name}/{label}/of_memcpy"] = spread(ratios)
            first = figures.get(f"{set_name}/{label}/first_batch_s")
            rows.append(
                [shown, median_spread(rates), median_spread(ratios, 2), median_spread(first, 2) if first else ""]
            )
        tables[f"{set_name.capitalize()} (batches of {batch})"] = rows
    write_results(
        "memory_speed",
        out,
        rounds=args.rounds,
        method={"images": args.images, "rows": args.rows, "workers": args.workers, "image_size": SIZE, "dim": DIM,
                "epochs": EPOCHS, "pixel_batch": 64, "row_batch": 1024, "run": args.run},
        tables=tables,
    )  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    main()
