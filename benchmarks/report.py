"""The "Latest results" section of benchmarks/README.md, made from benchmarks/results/*.json.

    python benchmarks/report.py            # prints the section
    python benchmarks/report.py --write    # and puts it into benchmarks/README.md between its markers

Each benchmark's tables as its run printed them, with the machine and the
rounds; its commit and date stay in its results file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import RESULTS, markdown_table

README = Path(__file__).resolve().parent / "README.md"
BEGIN, END = "<!-- results: made by benchmarks/report.py -->", "<!-- /results -->"
BENCHMARKS = {  # name -> what it measures, in the README's order
    "loader_speed": "Images per second at 256 px against this machine's decode limit",
    "referee": "The shared referee (../shared/bench), its latest run",
    "referee_before_after": "The referee's datacat loaders before and after a change",
    "memory_scale": "Memory against dataset size",
    "memory_speed": "Decoded pixels and embedding rows against memcpy",
    "remote_speed": "Loaders on a bucket",
    "shard_cache": "A bucket read through the node-local shard cache",
    "catalog_scale": "Start-up costs that grow with a catalog",
    "beam_convert": "`datacat convert` on Beam's DirectRunner",
}


def _machine(found: dict[str, object]) -> str:
    machine = found.get("machine")
    if not isinstance(machine, dict):
        return "an unrecorded machine"
    memory = f", {machine['memory_gib']} GiB" if machine.get("memory_gib") else ""
    return f"{machine.get('cpu')}, {machine.get('cores')} cores{memory}, Python {machine.get('python')}"


def section(name: str, title: str) -> str:
    """One benchmark's part of the section: its tables, or a line saying it has not been run."""
    path = RESULTS / f"{name}.json"
    lines = [f"### {title} (`{name}.py`)", ""]
    if not path.is_file():
        return "\n".join([*lines, f"Not measured yet: `python benchmarks/{name}.py` writes `results/{name}.json`."])
    found = json.loads(path.read_text())
    dirty = " (with uncommitted changes)" if found.get("dirty") else ""
    lines.append(
        f"{found.get('rounds')} round(s) on {_machine(found)}{dirty}; commit, date and every figure in "
        f"[`results/{name}.json`](results/{name}.json)."
    )
    for heading, rows in found.get("tables", {}).items():
        lines += ["", f"{heading}:", "", markdown_table(rows)]
    return "\n".join(lines)


def report() -> str:
    """The whole "Latest results" section, between its markers."""
    parts = [section(name, title) for name, title in BENCHMARKS.items()]
    return "\n\n".join([BEGIN, *parts, END])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="put the section into benchmarks/README.md")
    args = parser.parse_args()
    text = report()
    print(text)
    if args.write:
        readme = README.read_text()
        if BEGIN not in readme or END not in readme:
            sys.exit(f"{README}: no {BEGIN} ... {END} markers to write between")
        head, rest = readme.split(BEGIN, 1)
        README.write_text(head + text + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
