"""Loaders on a bucket: the GCS emulator behind a proxy that delays each response's first byte by D ms.

    python benchmarks/remote_speed.py [--images 600] [--delays 0,30,80] [--workers 2] [--batch 32] [--rounds 1]

GCS answers in 30-100 ms; one blocking GET per record caps a worker at
1/latency records/s. This builds a corpus of real-photo JPEGs (0.2-1 MP,
as benchmarks/corpus.py makes them), uploads it as tars and ArrayRecord
shards to a local gcp-storage-emulator (tests/storage_servers.py: threaded,
suffix ranges as GCS serves them), and runs each loader in its own process
against a proxy with delay D, side by side in one run:

    usual grain   grain.MapDataset over ArrayRecordDataSource(gs://...), 16 read threads, PIL decode + resize,
                  batch, mp_prefetch (the pipeline datacat replaces)
    datacat       torch over tars, torch over ArrayRecord, jax over ArrayRecord

Each loader reads two epochs; it prints images/s over the second (workers
and connections warm, as in training), the first batch's time (open
included, with an empty cache: the tar index is built then),
requests per image (every request the proxy saw, listing and index
included), and the ratios the issue asks for: each loader at D=80 against
itself at D=0, and datacat at D=80 against the usual grain pipeline at D=80.
With ``--rounds`` every loader runs again at every delay, each stream with an
empty cache; the tables show medians over rounds [min-max], ratios taken
inside each round, and benchmarks/results/remote_speed.json keeps every round.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from results import JSON, median_spread, spread, write_results  # noqa: E402

SIZE = 256
EPOCHS = 2
BUCKET = "bench-remote"
LOADERS = {
    "usual grain, ArrayRecord": ("grain", None),
    "datacat torch, tars": ("torch", "remote-tar"),
    "datacat torch, ArrayRecord": ("torch", "remote-ar"),
    "datacat jax, ArrayRecord": ("jax", "remote-ar"),
}


def write_catalog(folder: Path, shards: int) -> Path:
    last = shards - 1
    loading = f"{{image_size: {SIZE}, augmentation: flip_only, val_batches: 0}}"
    where = f"root: 'gs://{BUCKET}', storage_options: {{token: anon}}"
    path = folder / "remote.yaml"
    path.write_text(
        f"remote-tar: {{description: d, format: webdataset, location: {{{where}, path: tar, shards: '{{0000..{last:04d}}}.tar'}}, loading: {loading}}}\n"
        f"remote-ar: {{description: d, format: array_record, location: {{{where}, path: ar, shards: '{{0000..{last:04d}}}.ar'}}, "
        f"record: {{layout: packed, key: key}}, loading: {loading}}}\n"
    )
    return path


def run_grain(shards: int, workers: int, batch: int) -> dict[str, Any]:
    import io

    import grain
    from absl import flags
    from PIL import Image

    from datacat.formats.packed import unpack_record

    flags.FLAGS.mark_as_parsed()

    def transform(record: bytes) -> np.ndarray:
        image = Image.open(io.BytesIO(unpack_record(record)["jpg"])).convert("RGB")
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        return np.asarray(image.crop((left, top, left + side, top + side)).resize((SIZE, SIZE), Image.BICUBIC))

    start = time.perf_counter()
    source = grain.sources.ArrayRecordDataSource([f"gs://{BUCKET}/ar/{s:04d}.ar" for s in range(shards)])
    dataset = (
        grain.MapDataset.source(source)
        .shuffle(seed=0)
        .repeat(EPOCHS)
        .map(transform)
        .to_iter_dataset(grain.ReadOptions(num_threads=16, prefetch_buffer_size=64))
        .batch(batch)
        .mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=workers))
    )
    return _time(iter(dataset), lambda b: len(b), start, len(source))


def run_datacat(folder: Path, framework: str, name: str, workers: int, batch: int) -> dict[str, Any]:
    start = time.perf_counter()
    import datacat

    catalog = datacat.load_catalog([folder / "remote.yaml"])
    loader = datacat.open(
        name, framework=framework, batch_size=batch, num_workers=workers, catalog=catalog, epochs=EPOCHS
    )
    result = _time(iter(loader), lambda b: len(b["key"]), start, loader.schedule.records)
    result["retries"] = loader.retries
    return result


def _time(batches: Any, count: Any, start: float, per_epoch: int) -> dict[str, Any]:
    first = next(batches)
    first_batch = time.perf_counter() - start
    images = count(first)
    mark: tuple[int, float] | None = None
    last = time.perf_counter()
    for batch in batches:
        images += count(batch)
        last = time.perf_counter()
        if mark is None and images >= per_epoch:
            mark = (images, last)  # the first epoch is done: time the second
    assert mark is not None
    return {"images": images, "rate": (images - mark[0]) / (last - mark[1]), "first": first_batch}


def child(args: argparse.Namespace) -> None:
    kind, name = LOADERS[args.child]
    if kind == "grain":
        result = run_grain(args.shards, args.workers, args.batch)
    else:
        result = run_datacat(Path(args.folder), kind, name, args.workers, args.batch)
    print("RESULT " + json.dumps(result))


def upload(folder: Path, emulator_url: str, bucket: str = BUCKET) -> None:
    """The corpus's tar and ArrayRecord shards copied to ``bucket`` on the emulator."""
    import warnings

    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url=emulator_url)
    fs.mkdir(bucket)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for sub in ("tar", "ar"):
            for path in sorted((folder / sub).iterdir()):
                fs.pipe(f"{bucket}/{sub}/{path.name}", path.read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--delays", default="0,30,80", help="first-byte delays in ms, comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--only", default="", help="loader labels to run, separated by ;")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    from storage_servers import Emulator, FaultProxy

    from corpus import build_corpus

    labels = [label for label in LOADERS if not args.only or label in args.only.split(";")]
    delays = [int(d) for d in args.delays.split(",")]
    emulator = Emulator().start()
    results: dict[tuple[str, int], list[dict[str, Any]]] = {(label, d): [] for label in labels for d in delays}
    with tempfile.TemporaryDirectory(prefix="datacat-remote-") as tmp:
        folder = Path(tmp)
        build_corpus(folder, args.images, args.shards)
        write_catalog(folder, args.shards)
        upload(folder, emulator.url)
        for round_ in range(args.rounds):
            for delay in delays:
                proxy = FaultProxy(emulator.url, delay=delay / 1000).start()
                for label in labels:
                    cache = folder / f"cache-{round_}-{delay}-{label.replace(' ', '_').replace(',', '')}"
                    result = measure(label, delay, cache, proxy, args)
                    results[(label, delay)].append(result)
                    print(
                        f"round {round_ + 1} D={delay:3d} ms  {label:28s} {result['rate']:6.1f} img/s  "
                        f"first batch {result['first']:5.2f} s  {result['requests']:.3f} requests/image"
                        + (f"  retries {result['retries']}" if "retries" in result else ""),
                        flush=True,
                    )
                proxy.stop()
    emulator.stop()
    report(results, labels, delays, args)


def measure(label: str, delay: int, cache: Path, proxy: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Two epochs of ``label`` in a fresh process through ``proxy``, with an empty cache."""
    env = {
        **os.environ,
        "PYTHONWARNINGS": "ignore",
        "STORAGE_EMULATOR_HOST": proxy.url,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": proxy.url,
        "DATACAT_CACHE": str(cache),
    }
    command = [sys.executable, __file__, "--child", label, "--folder", str(cache.parent)]
    command += ["--workers", str(args.workers), "--batch", str(args.batch), "--shards", str(args.shards)]
    proxy.reset_counts()
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env, timeout=900)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{label} at D={delay} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    result["requests"] = proxy.requests / result["images"]
    return result


def report(
    results: dict[tuple[str, int], list[dict[str, Any]]], labels: list[str], delays: list[int], args: argparse.Namespace
) -> None:
    """The loaders' figures at each delay and the issue's ratios, each taken inside its round."""
    high, low = max(delays), min(delays)
    usual = results.get(("usual grain, ArrayRecord", high))
    rows = [["loader", "D ms", "img/s (2nd epoch)", "first batch s", "requests/image", "retries"]]
    figures: dict[str, JSON] = {}
    for (label, delay), runs in results.items():
        figure = {k: spread([r[k] for r in runs]) for k in ("rate", "first", "requests")}
        retries = [r["retries"] for r in runs if "retries" in r]
        if retries:
            figure["retries"] = spread(retries)
        figures[f"{label}, D={delay}"] = figure
        rows.append(
            [
                label,
                str(delay),
                median_spread([r["rate"] for r in runs], 1),
                median_spread([r["first"] for r in runs], 2),
                median_spread([r["requests"] for r in runs], 3),
                median_spread(retries) if retries else "",
            ]
        )
    ratios = [["loader", f"D={high} / D={low}", f"vs usual grain at D={high}"]]
    for label in labels:
        mine = [r["rate"] for r in results[(label, high)]]
        slowed = [m / r["rate"] for m, r in zip(mine, results[(label, low)], strict=True)]
        versus = (
            [m / u["rate"] for m, u in zip(mine, usual, strict=True)]
            if usual and label != "usual grain, ArrayRecord"
            else []
        )
        figures[f"{label}: D={high} over D={low}"] = spread(slowed)
        if versus:
            figures[f"{label}: over usual grain at D={high}"] = spread(versus)
        ratios.append([label, median_spread(slowed, 2, "x"), median_spread(versus, 2, "x") if versus else ""])
    write_results(
        "remote_speed",
        figures,
        rounds=args.rounds,
        method={
            "images": args.images,
            "shards": args.shards,
            "delays_ms": delays,
            "workers": args.workers,
            "batch": args.batch,
            "size": SIZE,
            "epochs": EPOCHS,
        },
        tables={
            f"Loaders on a bucket behind a first-byte delay D, {SIZE} px, medians over rounds [min-max]": rows,
            "Ratios, each taken inside its round": ratios,
        },
    )


if __name__ == "__main__":
    main()
