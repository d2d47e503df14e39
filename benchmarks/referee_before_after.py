"""The referee's datacat loaders on two checkouts of datacat, side by side in one run: before and after a change.

    python benchmarks/referee_before_after.py --before /path/to/old/checkout [--after .] [--rounds 3]

Runs the referee (``shared/bench/bench_pipeline.py CORPUS --only
DCt,DCa,DCj --json ...``, see its README) once per round for each checkout,
each with that checkout first on ``PYTHONPATH`` and a datacat cache of its
own; the bench venv (``--python``) provides the libraries. The two
alternate, and swap order every round (before, after; after, before; ...), so
a drift of the machine's speed falls on both alike. Before the first round
each checkout is checked to be the datacat that imports.

Reports each loader's steady images/s and CPU-ms per image per checkout
(medians over rounds [min-max]) and the after/before ratio of images/s taken
inside each round, whose median is the figure to read: the referee's README
counts differences under ~10 % as noise. Writes
benchmarks/results/referee_before_after.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import JSON, ROOT, checkout_state, median_spread, spread, write_results

BENCH_VENV = Path.home() / ".cache" / "datacat-bench"
NOISE = 0.10  # the referee's README: treat differences under ~10 % as noise
FIGURES = ("images_per_s", "cpu_ms_per_image", "one_epoch_first_batch_s")


def find_referee() -> Path | None:
    """shared/bench/bench_pipeline.py in this checkout's folder or one above it."""
    for folder in ROOT.parents:
        if (candidate := folder / "shared" / "bench" / "bench_pipeline.py").is_file():
            return candidate
    return None


def _env(checkout: Path, cache: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(checkout), "DATACAT_CACHE": str(cache), "PYTHONWARNINGS": "ignore"}


def check_imports(python: str, checkout: Path, cache: Path) -> None:
    """Exits unless ``import datacat`` under this checkout's environment loads the checkout's own datacat."""
    done = subprocess.run(
        [python, "-c", "import datacat; print(datacat.__file__)"],
        env=_env(checkout, cache),
        cwd=cache.parent,  # not this checkout's root: `python -c` puts the working folder first on sys.path
        capture_output=True,
        text=True,
        check=False,
    )
    found = Path(done.stdout.strip()).resolve() if done.returncode == 0 else None
    if found is None or not found.is_relative_to(checkout):
        sys.exit(f"{checkout}: `import datacat` with it on PYTHONPATH loads {found or done.stderr.strip()[-500:]}")


def run_referee(args: argparse.Namespace, checkout: Path, cache: Path, out: Path) -> dict[str, dict[str, float]]:
    """One referee run of ``--only`` on ``checkout``: each loader's figures."""
    command = [args.python, str(args.referee), str(args.corpus), "--only", args.only, "--json", str(out)]
    if args.quiet_budget is not None:
        command += ["--quiet-budget", str(args.quiet_budget)]
    done = subprocess.run(command, env=_env(checkout, cache), cwd=cache.parent, check=False)
    if done.returncode != 0 or not out.is_file():
        sys.exit(f"the referee failed on {checkout} (exit {done.returncode}): {' '.join(command)}")
    found = json.loads(out.read_text())["results"]
    return {name: {k: float(found[name][k]) for k in FIGURES} for name in args.only.split(",")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, type=Path, help="the checkout to compare against")
    parser.add_argument("--after", type=Path, default=ROOT, help="the changed checkout (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="DCt,DCa,DCj", help="the referee's datacat loaders (DCj last: jax)")
    parser.add_argument("--python", default=str(BENCH_VENV / "bin" / "python"), help="the bench venv's python")
    parser.add_argument("--corpus", type=Path, default=BENCH_VENV / "corpus", help="made by make_corpus.py")
    parser.add_argument("--referee", type=Path, default=find_referee(), help="bench_pipeline.py")
    parser.add_argument("--quiet-budget", type=float, help="passed to the referee (seconds; 0 = no quiet gate)")
    args = parser.parse_args()
    if args.referee is None or not args.referee.is_file():
        sys.exit("no shared/bench/bench_pipeline.py above this checkout: name it with --referee")
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    names = args.only.split(",")
    runs: dict[str, list[dict[str, dict[str, float]]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="datacat-referee-") as scratch:
        caches = {side: Path(scratch) / f"cache-{side}" for side in sides}
        for side, checkout in sides.items():
            check_imports(args.python, checkout, caches[side])
        for side, checkout in sides.items():  # unrecorded: fills each checkout's cache (tar index, manifests)
            print(f"warm-up: {side} ({checkout})", flush=True)
            run_referee(args, checkout, caches[side], Path(scratch) / f"{side}-warm-up.json")
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for side in order:
                print(f"round {round_ + 1}/{args.rounds}: {side} ({sides[side]})", flush=True)
                out = Path(scratch) / f"{side}-{round_}.json"
                runs[side].append(run_referee(args, sides[side], caches[side], out))
    report(runs, names, sides, args)


def report(
    runs: dict[str, list[dict[str, dict[str, float]]]],
    names: list[str],
    sides: dict[str, Path],
    args: argparse.Namespace,
) -> None:
    """Each loader's figures per checkout and the in-round after/before ratio, written and printed."""
    rows = [
        [
            "loader",
            "before img/s",
            "after img/s",
            "after / before (in-round)",
            f"within {NOISE:.0%}",
            "before CPU-ms/img",
            "after CPU-ms/img",
        ]
    ]
    figures: dict[str, JSON] = {}
    for name in names:
        per_side = {side: {k: [r[name][k] for r in runs[side]] for k in FIGURES} for side in sides}
        ratios = [  # a round where either side gave no steady rate (NaN) gives no ratio
            a / b
            for a, b in zip(per_side["after"]["images_per_s"], per_side["before"]["images_per_s"], strict=True)
            if math.isfinite(a) and math.isfinite(b)
        ]
        figures[name] = {
            **{side: {k: spread(v) for k, v in values.items()} for side, values in per_side.items()},
            "after_over_before_images_per_s": spread(ratios),
        }
        rows.append(
            [
                name,
                median_spread(per_side["before"]["images_per_s"]),
                median_spread(per_side["after"]["images_per_s"]),
                median_spread(ratios, 3),
                ("yes" if abs(statistics.median(ratios) - 1) < NOISE else "NO") if ratios else "no figure",
                median_spread(per_side["before"]["cpu_ms_per_image"], 2),
                median_spread(per_side["after"]["cpu_ms_per_image"], 2),
            ]
        )
    write_results(
        "referee_before_after",
        figures,
        rounds=args.rounds,
        method={
            "referee": args.referee.name,
            "only": args.only,
            "corpus_images": _corpus_images(args.corpus),
            "quiet_budget_s": args.quiet_budget,
            "order": "before, after; then after, before; alternating per round",
            "warm_up": "one unrecorded run of each checkout first, filling its own cache",
            **{side: checkout_state(checkout) for side, checkout in sides.items()},
        },
        tables={"The referee's datacat loaders, before and after, medians over rounds [min-max]": rows},
        checkout=sides["after"],
    )


def _corpus_images(corpus: Path) -> JSON:
    try:
        manifest: dict[str, JSON] = json.loads((corpus / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("n")


if __name__ == "__main__":
    main()
