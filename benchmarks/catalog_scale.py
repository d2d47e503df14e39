"""Start-up costs that grow with a catalog: `datacat describe` of a 10k-shard entry, and a 30M-record mixture's schedule.

    python benchmarks/catalog_scale.py [--shards 10000] [--runs 7]

Writes an ArrayRecord entry on gs:// with ``--shards`` shards and a
``per_shard`` count for each (as `datacat verify` or a converter writes
them), then times `datacat describe` in a fresh process ``--runs`` times
(imports included, no storage touched) and prints the median and the
range: the machine is noisy, one run says little. Then times, in this
process, ``--runs`` times, the first batch's record indices of the last rank's last worker
of 64 ranks x 8 workers over a 4-component, 30M-record mixture, and the
memory that took.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import median_spread, spread, write_results


def write_entry(folder: Path, shards: int) -> Path:
    counts = {f"{i:05d}.array_record": 900 + (i * 7919) % 200 for i in range(shards)}
    path = folder / "big.yaml"
    path.write_text(
        "big:\n  description: a 10k-shard entry\n  format: array_record\n"
        f"  location: {{root: 'gs://bucket', path: ar, shards: '{{00000..{shards - 1:05d}}}.array_record'}}\n"
        f"  totals:\n    shards: {shards}\n    samples: {sum(counts.values())}\n"
        "    per_shard: {" + ", ".join(f"{k}: {v}" for k, v in counts.items()) + "}\n"
        "  record: {layout: packed, key: key}\n"
    )
    return path


def time_describe(catalog: Path, runs: int) -> list[float]:
    env = {**os.environ, "DATACAT_CATALOG": str(catalog)}
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "datacat", "describe", "big"], env=env, capture_output=True, text=True, check=False
        )
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            sys.exit(f"describe failed:\n{done.stdout}{done.stderr}")
    return times


def time_mixture() -> tuple[float, float]:
    from datacat.loading.mixture import Draws

    sizes = (12_000_000, 10_000_000, 5_000_000, 3_000_000)
    tracemalloc.start()
    start = time.perf_counter()
    draws = Draws(sizes, (0.4, 0.3, 0.2, 0.1), "stop_on_all", key=0)
    first = 30_000_000 * 511 // 512
    located = [draws.locate(first + i) for i in range(256)]
    took = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    assert len(set(located)) == 256
    return took, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="datacat-scale-") as tmp:
        catalog = write_entry(Path(tmp), args.shards)
        times = time_describe(catalog, args.runs)
    mixtures = [time_mixture() for _ in range(args.runs)]
    took, peak = [m[0] for m in mixtures], [m[1] for m in mixtures]
    rows = [
        ["figure", "median [min-max]"],
        [f"`datacat describe`, {args.shards} shards with per_shard, fresh process", median_spread(times, 2, " s")],
        ["30M-record 4-component mixture, last worker of 64 x 8: first batch's draws", median_spread(took, 3, " s")],
        ["the same: peak memory traced", median_spread(peak, 1, " MiB")],
    ]
    write_results(
        "catalog_scale",
        {"describe_s": spread(times), "mixture_first_batch_s": spread(took), "mixture_peak_mib": spread(peak)},
        rounds=args.runs,
        method={"shards": args.shards, "runs": args.runs},
        tables={"Start-up costs that grow with a catalog": rows},
    )


if __name__ == "__main__":
    main()
