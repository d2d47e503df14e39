"""The shared referee's run (../shared/bench) kept as benchmarks/results/referee.json.

    OUT=~/.cache/datacat-bench/results bash ../shared/bench/run_all.sh      # the referee, its default 3 rounds
    python benchmarks/referee.py ~/.cache/datacat-bench/results --commit HASH

HASH is the commit the referee's venv installed (it installs a copy, not the
checkout). Every round's decode and pipeline figures are kept as the
referee wrote them, and its markdown tables as rows for ``report.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import JSON, write_results


def markdown_tables(text: str) -> dict[str, list[list[str]]]:
    """The tables of a markdown text, each titled by its header row's first cell (its separator row dropped)."""
    tables: dict[str, list[list[str]]] = {}
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not all(set(cell) <= set("-: ") for cell in cells):
                rows.append(cells)
        elif rows:
            tables[f"referee: {rows[0][0]}"] = rows
            rows = []
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the referee's OUT folder")
    parser.add_argument("--commit", required=True, help="the datacat commit the referee measured")
    args = parser.parse_args()
    rounds = sorted(args.out.glob("round*"))
    figures: dict[str, JSON] = {
        f"{folder.name}/{kind}": json.loads((folder / f"{kind}.json").read_text())
        for folder in rounds
        for kind in ("decode", "pipeline")
    }
    write_results(
        "referee",
        figures,
        rounds=len(rounds),
        method={"measured_commit": args.commit, "script": "../shared/bench/run_all.sh"},
        tables=markdown_tables((args.out / "tables.md").read_text()),
    )


if __name__ == "__main__":
    main()
