"""Memory against dataset size: each loader's resident memory over one epoch of 1k, 10k and 100k records.

    python benchmarks/memory_scale.py [--counts 1000,10000,100000] [--workers 2] [--batch 64] [--rounds 1]

Writes one dataset per count (small JPEGs, 10 shards, as webdataset tars
and ArrayRecord shards, per-shard counts declared), then, for each of
datacat's three loaders and each count, reads one whole epoch in a fresh
process and samples the resident memory (VmRSS, from /proc: Linux) of the
loader's process and of all its descendants (workers, a forkserver) every
16 batches. It prints the peak of each and the growth within the epoch
(last sample less the one after the first 10 %): a loader whose memory
follows the records (a key list, a permutation array, a ledger of every
sample) shows it from 1k to 100k records. Each run is a first open: the
tars are indexed in it (into a cache of the run's own, removed after).
Images are 48 px JPEGs loaded at 32 px, so 100k records take seconds:
memory is measured here, not speed. With ``--rounds`` the loaders run
again in turn; the table shows medians over rounds [min-max], and
benchmarks/results/memory_scale.json keeps every round.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from results import JSON, median_spread, spread, write_results

ROOT = Path(__file__).resolve().parent.parent
SHARDS = 10
LOADERS = {
    "datacat torch, tars": ("torch", "tar"),
    "datacat torch, ArrayRecord": ("torch", "ar"),
    "datacat jax, ArrayRecord": ("jax", "ar"),
}


def jpegs(n: int) -> list[bytes]:
    """``n`` distinct 48 px JPEGs cut from the licensed test photos."""
    photo = np.asarray(Image.open(ROOT / "tests" / "data" / "images" / "skimage" / "astronaut.png").convert("RGB"))
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        y, x = (int(v) for v in rng.integers(0, 512 - 96, size=2))
        buffer = io.BytesIO()
        Image.fromarray(photo[y : y + 96, x : x + 96]).resize((48, 48)).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def build(folder: Path, count: int, pool: list[bytes]) -> None:
    """``count`` records in SHARDS tars and SHARDS ArrayRecord shards under folder, and their catalog."""
    from array_record.python import array_record_module

    from shards import write_sample  # benchmarks/, this script's folder

    (folder / "tar").mkdir(parents=True)
    (folder / "ar").mkdir()
    per_shard = {}
    for shard in range(SHARDS):
        indices = range(shard * count // SHARDS, (shard + 1) * count // SHARDS)
        writer = array_record_module.ArrayRecordWriter(str(folder / "ar" / f"{shard:04d}.ar"), "group_size:1")
        with tarfile.open(folder / "tar" / f"{shard:04d}.tar", "w") as tar:
            for i in indices:
                write_sample(tar, writer, f"{i:08d}", pool[i % len(pool)], f"record {i}")
        writer.close()
        per_shard[f"{shard:04d}"] = len(indices)
    loading = "{image_size: 32, augmentation: none, val_batches: 0}"
    shards = f"'{{0000..{SHARDS - 1:04d}}}"
    for kind, fmt, extra in (("tar", "webdataset", ""), ("ar", "array_record", ", record: {layout: packed, key: key}")):
        counts = ", ".join(f"{k}.{kind}: {v}" for k, v in per_shard.items())
        (folder / f"{kind}.yaml").write_text(
            f"data: {{description: {count} records, format: {fmt}, location: {{root: {kind}, shards: {shards}.{kind}'}}"
            f"{extra}, totals: {{per_shard: {{{counts}}}}}, loading: {loading}}}\n"
        )


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def child(label: str, folder: Path, workers: int, batch: int) -> dict[str, float]:
    """One epoch of ``label`` over folder's dataset, its memory sampled every 16 batches."""
    import datacat

    framework, kind = LOADERS[label]
    catalog = datacat.load_catalog([folder / f"{kind}.yaml"])
    loader = datacat.open("data", framework=framework, catalog=catalog, batch_size=batch, num_workers=workers, seed=0)
    me, samples, records = os.getpid(), [], 0
    batches = len(loader)
    for step, out in enumerate(loader):
        records += len(out["key"])
        if step % 16 == 0 or step == batches - 1:
            workers_kib = sum(_rss_kib(pid) for pid in _descendants(me))
            samples.append((step / batches, _rss_kib(me), workers_kib))
    settled = next(s for s in samples if s[0] >= 0.1) if samples[-1][0] >= 0.1 else samples[0]
    last = samples[-1]
    return {
        "records": records,
        "main_peak_mb": max(s[1] for s in samples) / 1024,
        "workers_peak_mb": max(s[2] for s in samples) / 1024,
        "growth_mb": (last[1] + last[2] - settled[1] - settled[2]) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--counts", default="1000,10000,100000")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, Path(args.folder), args.workers, args.batch)))
        return
    counts = [int(c) for c in args.counts.split(",")]
    pool = jpegs(256)
    with tempfile.TemporaryDirectory(prefix="datacat-memory-") as tmp:
        for count in counts:
            build(Path(tmp) / str(count), count, pool)
        print(
            f"{len(counts)} datasets of {', '.join(map(str, counts))} records, {SHARDS} shards each; "
            f"batch {args.batch}, {args.workers} workers; one epoch each, in a fresh process\n"
        )
        rounds: dict[tuple[str, int], list[dict[str, float]]] = {(label, c): [] for label in LOADERS for c in counts}
        for round_ in range(args.rounds):
            for label in LOADERS:
                for count in counts:
                    r = measure(label, count, Path(tmp), round_, args)
                    rounds[(label, count)].append(r)
                    print(
                        f"  round {round_ + 1}: {label}, {count} records: main peak {r['main_peak_mb']:.0f} MB, "
                        f"workers peak {r['workers_peak_mb']:.0f} MB, growth {r['growth_mb']:.1f} MB",
                        flush=True,
                    )
    rows = [["loader", "records", "main peak MB", "workers peak MB", "growth in the epoch MB"]]
    figures: dict[str, JSON] = {}
    for (label, count), runs in rounds.items():
        keys = ("main_peak_mb", "workers_peak_mb", "growth_mb")
        figures[f"{label}, {count} records"] = {k: spread([r[k] for r in runs]) for k in keys}
        rows.append(
            [label, str(count), *(median_spread([r[k] for r in runs], 1 if k == "growth_mb" else 0) for k in keys)]
        )
    write_results(
        "memory_scale",
        figures,
        rounds=args.rounds,
        method={"counts": counts, "shards": SHARDS, "workers": args.workers, "batch": args.batch, "image_px": 32},
        tables={"Resident memory over one epoch, medians over rounds [min-max]": rows},
    )


def measure(label: str, count: int, tmp: Path, round_: int, args: argparse.Namespace) -> dict[str, float]:
    """One epoch of ``label`` over the dataset of ``count`` records, in a fresh process (a cache of the round's own)."""
    command = [sys.executable, __file__, "--child", label, "--folder", str(tmp / str(count))]
    command += ["--workers", str(args.workers), "--batch", str(args.batch)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "DATACAT_CACHE": str(tmp / f"cache-{round_}")}
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env, cwd=tmp)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{label} over {count} records failed:\n{done.stderr[-3000:]}")
    r: dict[str, float] = json.loads(line[len("RESULT ") :])
    if r["records"] != count:
        sys.exit(f"{label} read {r['records']} of {count} records")
    return r


if __name__ == "__main__":
    main()
