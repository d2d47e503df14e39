from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from datacat.cli import main

INVALID = Path(__file__).parent / "catalogs" / "invalid"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_list_shows_every_entry_with_counts() -> None:
    code, out = run("list")
    assert code == 0
    for name in (
        "CC3M",
        "CC12M",
        "Laion12mCoco",
        "Laion2bAesthetic",
        "DiffusionDB",
        "CombinedMsml612",
        "Combined30M",
        "sample",
    ):
        assert name in out
    assert "49 (1 missing)" in out and "37.0 GiB" in out and "~3.3M" in out


def test_list_json_parses() -> None:
    code, out = run("list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert code == 0
    assert rows["CC3M"]["shards"] == 49 and rows["CC3M"]["missing"] == 1 and rows["CC3M"]["samples"] == 3_300_000
    assert rows["Laion2bAesthetic"]["shards"] == 569 and rows["DiffusionDB"]["bytes"] == 60 * 2**30
    assert rows["Combined30M"]["components"][1] == "CC12M"


def test_describe_cc3m() -> None:
    code, out = run("describe", "cc3m")
    assert code == 0
    assert "{00000..00049}.array_record" in out
    assert "49 resolved URLs of 50 named; missing: 00039.array_record" in out
    assert "3,300,000" in out and "37.0 GiB" in out
    assert "gs://msml612/arrayrecord2/cc3m/00038.array_record" not in out  # abridged without --all-shards
    code, out = run("describe", "cc3m", "--all-shards")
    assert "00038.array_record" in out and "/00039.array_record\n" not in out.split("missing shards")[0]


def test_describe_mixture_shows_weights() -> None:
    code, out = run("describe", "Combined30M")
    assert code == 0 and out.count("0.2500") == 4


def test_describe_json_and_user_catalog(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    (tmp_path / "my.yaml").write_text(
        "cc3m:\n  description: my local copy\n  format: webdataset\n  location: {root: shards, shards: '{0..2}.tar', missing: [1]}\n"
    )
    code, out = run("--catalog", str(tmp_path / "my.yaml"), "describe", "CC3M")
    assert code == 0
    assert "overrides:  the entry in catalog/cc3m.yaml" in out or "overrides:  the entry in" in out
    assert str(tmp_path / "shards" / "0.tar") in out and str(tmp_path / "shards" / "2.tar") in out
    code, out = run("--catalog", str(tmp_path / "my.yaml"), "describe", "cc3m", "--json")
    info = json.loads(out)
    assert [s["name"] for s in info["plan"]["shards"]] == ["0.tar", "2.tar"]


def test_unknown_name_exits_1_with_suggestion() -> None:
    code, out = run("describe", "cc12N")
    assert code == 1 and "Did you mean 'CC12M'" in out and "Traceback" not in out


def test_validate_reports_every_problem_and_exits_1() -> None:
    code, out = run("validate", str(INVALID / "five_mistakes.yaml"))
    lines = [line for line in out.splitlines() if "five_mistakes.yaml:" in line]
    assert code == 1 and len(lines) == 5
    code, out = run("validate")
    assert code == 0 and "entries valid" in out


def test_schema_is_json_schema_of_a_catalog_file() -> None:
    code, out = run("schema")
    doc = json.loads(out)
    assert code == 0 and doc["additionalProperties"] == {"$ref": "#/$defs/Entry"}
    assert "missing" in doc["$defs"]["Location"]["properties"]


def test_console_script_runs_from_another_directory(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("datacat")
    result = subprocess.run([str(exe), "describe", "sample"], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "sample" in result.stdout and "webdataset" in result.stdout


def test_count_prints_the_totals_an_entry_declares() -> None:
    import yaml

    import datacat

    code, out = run("count", "sample")
    assert code == 0, out
    counted = yaml.safe_load(out)["totals"]
    declared = datacat.load_catalog()["sample"].totals
    assert counted["per_shard"] == declared.per_shard and counted["samples"] == declared.samples == 55


def test_version_and_counts_a_person_can_read() -> None:
    from datacat.cli import _human

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == "datacat, version 0.1.0"
    assert [_human(500_000), _human(12_345_678), _human(3_300_000, approx=True), _human(999)] == [
        "500k",
        "12.3M",
        "~3.3M",
        "999",
    ]


def test_list_never_cuts_a_name_on_a_narrow_terminal(monkeypatch) -> None:
    from rich.console import Console

    import datacat.cli as cli

    monkeypatch.setattr(cli, "out", Console(width=80, highlight=False, force_terminal=False))
    with cli.out.capture() as captured:
        CliRunner().invoke(main, ["list"])
    text = captured.get()
    assert "aestheticCoyo_0.26_clip_5.5aesthetic_256plus" in text
    assert "playground+leonardo_x4+cc3m.parquet" in text
