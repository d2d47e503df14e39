"""A benchmark's results file: benchmarks/results/<name>.json with the commit, date, machine and every figure.

Every script in benchmarks/ ends with :func:`write_results` and prints
:func:`markdown_table`; ``benchmarks/report.py`` turns the files back into
the tables of benchmarks/README.md.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TypeAlias

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent

JSON: TypeAlias = "Mapping[str, JSON] | Sequence[JSON] | str | int | float | bool | None"
# Read from the installed distributions' metadata, so nothing is imported: a torch-free run stays torch-free.
PACKAGES = (
    "numpy",
    "pillow",
    "simplejpeg",
    "opencv-python-headless",
    "array-record",
    "webdataset",
    "torch",
    "jax",
    "grain",
    "apache-beam",
)


def spread(values: Sequence[float]) -> dict[str, JSON]:
    """Each round's value, their median and their min/max."""
    raw = [float(v) for v in values]
    found = [v for v in raw if math.isfinite(v)]  # a round that gave no figure (NaN) is kept, not counted
    rounds: list[JSON] = [v if math.isfinite(v) else None for v in raw]
    if not found:
        return {"rounds": rounds, "median": None, "min": None, "max": None}
    return {"rounds": rounds, "median": statistics.median(found), "min": min(found), "max": max(found)}


def _git(checkout: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def checkout_state(checkout: Path = ROOT) -> dict[str, JSON]:
    """The commit a checkout is at and whether its tracked files differ from it (results files aside)."""
    changed = [
        line
        for line in _git(checkout, "status", "--porcelain", "--untracked-files=no").splitlines()
        if "benchmarks/results/" not in line
    ]
    return {"commit": _git(checkout, "rev-parse", "HEAD") or None, "dirty": bool(changed)}


def _first(path: str, prefix: str) -> str:
    try:
        with open(path) as lines:
            return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(prefix)), "")
    except OSError:
        return ""


def machine() -> dict[str, JSON]:
    """The CPU model, cores, memory, Python and the versions of the packages that set the figures."""
    memory_kib = _first("/proc/meminfo", "MemTotal")
    versions: dict[str, JSON] = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return {
        "cpu": _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(memory_kib.split()[0]) / 2**20, 1) if memory_kib else None,
        "system": platform.platform(),
        "python": platform.python_version(),
        "packages": versions,
    }


def write_results(
    name: str,
    figures: Mapping[str, JSON],
    *,
    rounds: int,
    method: Mapping[str, JSON],
    tables: Mapping[str, Sequence[Sequence[str]]],
    checkout: Path = ROOT,
) -> Path:
    """Writes benchmarks/results/<name>.json, prints its tables in markdown and returns its path.

    Args:
        name: the benchmark's name, the file's stem.
        figures: every figure measured, each round's values kept (see :func:`spread`).
        rounds: how many rounds the contenders ran, side by side.
        method: the run's parameters (sizes, workers, batch, ...).
        tables: the printed tables by title, each a header row then its rows, for ``report.py``.
        checkout: the datacat checkout measured.
    """
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{name}.json"
    document: dict[str, JSON] = {
        "benchmark": name,
        **checkout_state(checkout),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "rounds": rounds,
        "method": dict(method),
        "figures": dict(figures),
        "tables": {title: [list(row) for row in rows] for title, rows in tables.items()},
    }
    out.write_text(json.dumps(document, indent=1) + "\n")
    for title, rows in tables.items():
        print(f"\n{title}\n\n{markdown_table(rows)}")
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return out


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of a header row and its rows."""
    header, *body = rows
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def median_spread(values: Sequence[float], digits: int = 0, unit: str = "") -> str:
    """``median [min-max]`` of a round's values, as the tables show them; just the value for one round."""
    found = [v for v in values if math.isfinite(v)]
    if not found:
        return "no figure"
    median = f"{statistics.median(found):.{digits}f}{unit}"
    missing = f" ({len(values) - len(found)} round(s) gave none)" if len(found) < len(values) else ""
    if len(found) < 2:
        return median + missing
    return f"{median} [{min(found):.{digits}f}-{max(found):.{digits}f}]{missing}"
