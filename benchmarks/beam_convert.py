"""Throughput of ``datacat convert`` on Beam's DirectRunner next to a plain single-process loop, in one run.

    python benchmarks/beam_convert.py [--images 1200] [--workers 2] [--layout packed] [--records-per-shard 100] [--rounds 1]

Builds a corpus of real photos as webdataset tars (JPEGs of 0.2-1 MP, as
``corpus.py`` makes them for ``loader_speed.py``), then converts it to ArrayRecord twice:

- **plain loop**: one process reads every record in order, decodes it (a
  record that does not decode is left out, as the job does), packs it and
  writes the shards one after another: the same functions as the job's,
  no Beam;
- **DirectRunner**: ``datacat convert`` on ``--workers`` processes
  (``direct_running_mode=multi_processing``), Beam's start-up included;
  an empty job on the same runner is timed too, to show that start-up.

It prints images/s of each, their ratio, and whether both wrote the same
bytes (they must: a shard's bytes depend only on its number). With
``--rounds`` the three runs alternate again, each into a fresh folder; the
table shows medians over rounds [min-max], ratios taken inside each round.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from corpus import build_corpus  # noqa: E402
from results import median_spread, spread, write_results  # noqa: E402


def plain_loop(catalog: object, out: Path, layout: str, per_shard: int) -> float:
    """Seconds to convert the corpus in this process, shard after shard."""
    from array_record.python import array_record_module

    import datacat
    from datacat.beam.convert import Conversion, _open_view, _survey, converted_records
    from datacat.transforms.ledger import BadSample

    start = time.perf_counter()
    plan = datacat.resolve("bench", catalog=catalog, val_batches=0, augmentation="none", on_bad_sample="skip")
    total, _, _, _ = _survey(plan)
    job = Conversion(plan, str(out), layout, per_shard, records=total)
    view = _open_view(plan)
    shards = math.ceil(total / per_shard)
    out.mkdir(parents=True)
    for k in range(shards):
        writer = array_record_module.ArrayRecordWriter(str(out / job.shard_name(k, shards)), "group_size:1")
        for record in converted_records(view, range(k * per_shard, min(total, (k + 1) * per_shard)), layout):
            if not isinstance(record, BadSample):
                writer.write(record)
        writer.close()
    return time.perf_counter() - start


def on_beam(catalog: object, out: Path, layout: str, per_shard: int, workers: int) -> float:
    """Seconds of ``datacat convert`` on the DirectRunner with ``workers`` processes, start-up included."""
    from datacat.beam import pipeline_options
    from datacat.beam.convert import convert

    start = time.perf_counter()
    convert(
        "bench",
        str(out),
        catalog=catalog,  # type: ignore[arg-type]
        layout=layout,
        records_per_shard=per_shard,
        options=pipeline_options(workers=workers),
    )
    return time.perf_counter() - start


def start_up(workers: int) -> float:
    """Seconds of an empty job on the same runner: Beam's start-up and its worker processes."""
    import apache_beam as beam

    from datacat.beam import pipeline_options, run

    start = time.perf_counter()
    pipeline = beam.Pipeline(options=pipeline_options(workers=workers))
    _ = pipeline | beam.Create([0]) | beam.Reshuffle() | beam.Map(lambda x: x)
    run(pipeline)
    return time.perf_counter() - start


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.array_record"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=1200)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--layout", choices=["packed", "pre_resized"], default="packed")
    parser.add_argument("--records-per-shard", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    import datacat

    with tempfile.TemporaryDirectory(prefix="datacat-beam-bench-") as tmp:
        folder = Path(tmp)
        build_corpus(folder / "corpus", args.images, shards=8)
        (folder / "c.yaml").write_text(
            "bench:\n  description: benchmark corpus\n  format: webdataset\n"
            f"  location: {{root: {folder / 'corpus' / 'tar'}, shards: '{{0000..0007}}.tar'}}\n"
            "  loading: {image_size: 256, val_batches: 0}\n"
        )
        catalog = datacat.load_catalog([folder / "c.yaml"])
        datacat.resolve("bench", catalog=catalog)  # indexes the tars once, before either run is timed
        from datacat.loading.sources import SampleSource

        SampleSource(datacat.resolve("bench", catalog=catalog))
        loops, beams, empties, same = [], [], [], True
        for round_ in range(args.rounds):
            here = folder / f"round{round_}"
            loops.append(plain_loop(catalog, here / "loop", args.layout, args.records_per_shard))
            beams.append(on_beam(catalog, here / "beam", args.layout, args.records_per_shard, args.workers))
            empties.append(start_up(args.workers))
            same = same and digests(here / "loop") == digests(here / "beam")
            print(
                f"round {round_ + 1}: loop {loops[-1]:.1f} s, DirectRunner {beams[-1]:.1f} s, empty job {empties[-1]:.1f} s"
            )
    n = args.images
    rate = [n / t for t in loops], [n / t for t in beams]
    net = [n / max(b - e, 1e-9) for b, e in zip(beams, empties, strict=True)]
    rows = [
        ["run", "img/s", "seconds", "/ the loop's img/s"],
        ["plain single-process loop", median_spread(rate[0], 1), median_spread(loops, 2), ""],
        [
            f"DirectRunner, {args.workers} workers (Beam start-up included)",
            median_spread(rate[1], 1),
            median_spread(beams, 2),
            median_spread([lp / b for lp, b in zip(loops, beams, strict=True)], 2, "x"),
        ],
        ["an empty job on the same runner", "", median_spread(empties, 2), ""],
        [
            "DirectRunner less the empty job",
            median_spread(net, 1),
            "",
            median_spread([m * lp / n for m, lp in zip(net, loops, strict=True)], 2, "x"),
        ],
    ]
    print(f"convert {n} images ({args.layout}, {args.records_per_shard} per shard) on {args.workers} worker(s):")
    print(f"  same bytes written: {same}")
    write_results(
        "beam_convert",
        {
            "loop_s": spread(loops),
            "direct_runner_s": spread(beams),
            "empty_job_s": spread(empties),
            "direct_runner_over_loop": spread([lp / b for lp, b in zip(loops, beams, strict=True)]),
            "same_bytes": same,
        },
        rounds=args.rounds,
        method={
            "images": n,
            "workers": args.workers,
            "layout": args.layout,
            "records_per_shard": args.records_per_shard,
        },
        tables={f"datacat convert of {n} images ({args.layout}), medians over rounds [min-max]": rows},
    )


if __name__ == "__main__":
    main()
