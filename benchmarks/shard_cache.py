"""The node-local shard cache: a bucket 80 ms away read at the speed of local files once its shards are cached.

    python benchmarks/shard_cache.py [--images 600] [--shards 4] [--delay 80] [--workers 2] [--batch 32] [--rounds 3]

Builds a corpus of real-photo JPEGs (benchmarks/corpus.py) as tars and
ArrayRecord shards, uploads it to a local GCS emulator behind a proxy that
delays every first byte by ``--delay`` ms (tests/storage_servers.py), and runs,
each loader in its own process, side by side in one run:

    local files       datacat torch over the shards on local disk
    bucket, cache     the same loader over gs:// with a shard cache (empty at start)
    bucket, no cache  the same loader over gs:// reading byte ranges each epoch

for tars and for ArrayRecord. Each reads three epochs; the first fills the
cache (the cached loader then waits for its filler to finish, and reports
how long filling took), and the rate is taken over epochs 2 and 3, with the
requests the proxy saw in that window. The ratio the issue asks for,
``bucket, cache`` over ``local files``, is taken inside each round; the
tables show medians over rounds [min-max] and
benchmarks/results/shard_cache.json keeps every round.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from results import JSON, median_spread, spread, write_results  # noqa: E402

SIZE = 256
EPOCHS = 3
BUCKET = "bench-cache"
FORMATS = {"tars": "tar", "ArrayRecord": "ar"}
WAYS = ("local files", "bucket, cache", "bucket, no cache")


def write_catalog(folder: Path, shards: int, root: str, options: str) -> Path:
    last = shards - 1
    loading = f"{{image_size: {SIZE}, augmentation: flip_only, val_batches: 0}}"
    where = f"root: '{root}'" + (f", storage_options: {options}" if options else "")
    path = folder / f"catalog-{'remote' if options else 'local'}.yaml"
    path.write_text(
        f"tar: {{description: d, format: webdataset, location: {{{where}, path: tar, shards: '{{0000..{last:04d}}}.tar'}}, loading: {loading}}}\n"
        f"ar: {{description: d, format: array_record, location: {{{where}, path: ar, shards: '{{0000..{last:04d}}}.ar'}}, "
        f"record: {{layout: packed, key: key}}, loading: {loading}}}\n"
    )
    return path


def child(args: argparse.Namespace) -> None:
    """One loader's three epochs: the rate over epochs 2-3 and that window on the host's monotonic clock."""
    import datacat

    cache = datacat.ShardCache(args.cache, "100GB") if args.cache else None
    loader = datacat.open(
        args.name,
        framework="torch",
        batch_size=args.batch,
        num_workers=args.workers,
        catalog=datacat.load_catalog([args.catalog]),
        epochs=EPOCHS,
        shard_cache=cache,
    )
    per_epoch, images, fill = loader.schedule.records, 0, 0.0
    batches = iter(loader)
    start = time.monotonic()
    while images < per_epoch:
        images += len(next(batches)["key"])
    if loader.filler is not None:
        loader.filler.join()
        fill = time.monotonic() - start
    window_start = time.monotonic()
    timed = 0
    for batch in batches:
        timed += len(batch["key"])
    window_end = time.monotonic()
    rate = timed / (window_end - window_start)
    print("RESULT " + json.dumps({"rate": rate, "fill": fill, "window": [window_start, window_end], "images": timed}))


def measure(name: str, catalog: Path, cache: str, proxy: Any, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "DATACAT_CACHE": tempfile.mkdtemp(prefix="datacat-bench-")}
    command = [sys.executable, __file__, "--child", "--name", name, "--catalog", str(catalog), "--cache", cache]
    command += ["--workers", str(args.workers), "--batch", str(args.batch)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env, timeout=900)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    low, high = result.pop("window")
    result["requests"] = sum(low <= t <= high for t in proxy.times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--delay", type=int, default=80, help="first-byte delay of the bucket, ms")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--catalog", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from storage_servers import Emulator, FaultProxy

    emulator = Emulator().start()
    proxy = FaultProxy(emulator.url, delay=args.delay / 1000).start()
    os.environ["STORAGE_EMULATOR_HOST"] = os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] = proxy.url
    results: dict[tuple[str, str], list[dict[str, Any]]] = {(f, w): [] for f in FORMATS for w in WAYS}
    try:  # the emulator's server thread is not a daemon: stop it when a child fails, or the exit waits forever
        run_rounds(args, proxy, emulator.url, results)
    finally:
        proxy.stop()
        emulator.stop()
    report(results, args)


def run_rounds(
    args: argparse.Namespace, proxy: Any, emulator_url: str, results: dict[tuple[str, str], list[dict[str, Any]]]
) -> None:
    from corpus import build_corpus
    from remote_speed import upload

    with tempfile.TemporaryDirectory(prefix="datacat-shard-cache-") as tmp:
        folder = Path(tmp)
        build_corpus(folder, args.images, args.shards)
        upload(folder, emulator_url, BUCKET)
        local = write_catalog(folder, args.shards, str(folder), "")
        remote = write_catalog(folder, args.shards, f"gs://{BUCKET}", f"{{token: anon, endpoint_url: '{proxy.url}'}}")
        for round_ in range(args.rounds):
            for label, name in FORMATS.items():
                for way in WAYS:
                    cache = str(folder / f"cache-{round_}-{name}") if way == "bucket, cache" else ""
                    result = measure(name, local if way == "local files" else remote, cache, proxy, args)
                    results[(label, way)].append(result)
                    print(
                        f"round {round_ + 1} {label:12s} {way:17s} {result['rate']:7.1f} img/s (epochs 2-3)  "
                        f"{result['requests']} requests then"
                        + (f"  filled in {result['fill']:.1f} s" if cache else ""),
                        flush=True,
                    )


def report(results: dict[tuple[str, str], list[dict[str, Any]]], args: argparse.Namespace) -> None:
    rows = [["format", "loader", "img/s (epochs 2-3)", "requests in epochs 2-3", "cache filled in s"]]
    ratios = [["format", "bucket + cache / local files", "bucket, no cache / local files"]]
    figures: dict[str, JSON] = {}
    for (label, way), runs in results.items():
        figures[f"{label}, {way}"] = {k: spread([r[k] for r in runs]) for k in ("rate", "requests", "fill")}
        fill = median_spread([r["fill"] for r in runs], 1) if way == "bucket, cache" else ""
        rows.append(
            [
                label,
                way,
                median_spread([r["rate"] for r in runs], 1),
                median_spread([r["requests"] for r in runs]),
                fill,
            ]
        )
    for label in FORMATS:
        local = [r["rate"] for r in results[(label, "local files")]]
        cached = [r["rate"] / base for r, base in zip(results[(label, "bucket, cache")], local, strict=True)]
        bare = [r["rate"] / base for r, base in zip(results[(label, "bucket, no cache")], local, strict=True)]
        figures[f"{label}: cache over local"] = spread(cached)
        figures[f"{label}: no cache over local"] = spread(bare)
        ratios.append([label, median_spread(cached, 2, "x"), median_spread(bare, 2, "x")])
    write_results(
        "shard_cache",
        figures,
        rounds=args.rounds,
        method={
            "images": args.images,
            "shards": args.shards,
            "delay_ms": args.delay,
            "workers": args.workers,
            "batch": args.batch,
            "size": SIZE,
            "epochs": EPOCHS,
        },
        tables={
            f"datacat torch, local files vs gs:// {args.delay} ms away, {SIZE} px, medians over rounds [min-max]": rows,
            "Ratios to local files, each taken inside its round": ratios,
        },
    )


if __name__ == "__main__":
    main()
