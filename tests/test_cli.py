from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from datacat.catalog import builtin_catalog_dir
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
    line = next(line for line in out.splitlines() if "overrides:" in line)
    shown = line.split("overrides:  the entry in ", 1)[1].strip()
    assert Path(shown).resolve() == (builtin_catalog_dir() / "cc3m.yaml").resolve(), line
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
    from datacat.cli._shared import human_count as _human

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

    import datacat.cli.catalog_commands as cli

    monkeypatch.setattr(cli, "out", Console(width=80, highlight=False, force_terminal=False))
    with cli.out.capture() as captured:
        CliRunner().invoke(main, ["list"])
    text = captured.get()
    assert "aestheticCoyo_0.26_clip_5.5aesthetic_256plus" in text
    assert "playground+leonardo_x4+cc3m.parquet" in text


LEAKY = """
leaky:
  description: a bucket read with a raw access token
  format: webdataset
  location:
    root: gs://datacat-leak-test/shards
    shards: "{0..1}.tar"
    storage_options: {token: "${DATACAT_TEST_TOKEN}"}
  totals: {per_shard: {0.tar: 5, 1.tar: 5}}
"""

SCRIPT = """
import logging, sys
import datacat
logging.basicConfig(level=logging.DEBUG)  # every library's log lines, as a debugging user would see them
try:
    datacat.open("leaky", framework="torch", batch_size=2, catalog=datacat.load_catalog([sys.argv[1]]))
except datacat.DatacatError as exc:
    print("CAUGHT", type(exc).__name__, exc)
"""


@pytest.mark.slow
def test_storage_options_values_are_never_printed(tmp_path: Path) -> None:
    import os
    import urllib.parse

    secret = "ya29.s3cr3t/T0ken+value=="
    catalog = tmp_path / "leaky.yaml"
    catalog.write_text(LEAKY)
    (tmp_path / "probe.py").write_text(SCRIPT)
    # gcsfs checks a raw token at oauth2.googleapis.com/tokeninfo?access_token=<token>; a closed proxy
    # makes that fail at once, offline, with the URL (and so the token) in the client's error text.
    env = {**os.environ, "DATACAT_TEST_TOKEN": secret, "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    env.pop("STORAGE_EMULATOR_HOST", None)
    env.pop("https_proxy", None)
    cli = [sys.executable, "-c", "from datacat.cli import main; main()", "--catalog", str(catalog)]
    runs = [
        subprocess.run(
            [*cli, "load", "leaky", "--framework", "torch"], capture_output=True, text=True, env=env, timeout=120
        ),
        subprocess.run(
            [sys.executable, str(tmp_path / "probe.py"), str(catalog)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        ),
    ]
    assert runs[0].returncode == 1 and "CAUGHT ShardError" in runs[1].stdout, runs[1].stderr[-2000:]
    for done in runs:
        text = done.stdout + done.stderr
        assert "gs://datacat-leak-test/shards/0.tar" in text and "<redacted>" in text, text[-2000:]
        for form in (secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret), "s3cr3t"):
            assert form not in text, f"{form!r} printed:\n{text[-3000:]}"


@pytest.mark.slow
def test_the_readmes_own_dataset_example_loads_as_written(tmp_path: Path) -> None:
    from helpers import make_tar, sample_members

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("# ~/datasets/catalog.yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "catalog.yaml").write_text(block)
    (tmp_path / "shards").mkdir()
    for shard in range(3):  # "3 tar shards" of holiday photos, 10 each, no counts declared
        make_tar(tmp_path / "shards" / f"{shard:03d}.tar", sample_members([f"{shard}{i:03d}" for i in range(10)]))
    code, out = run("--catalog", str(tmp_path / "catalog.yaml"), "validate")
    assert code == 0, out
    code, out = run(
        "--catalog", str(tmp_path / "catalog.yaml"), "load", "my-photos", "--workers", "0", "--batch-size", "4"
    )
    assert code == 0, out
    assert "8 batch(es)" in out and "no bad samples in 30 read" in out, out
    code, out = run("--catalog", str(tmp_path / "catalog.yaml"), "describe", "my-photos")
    assert code == 0 and "samples: 30 (counted when first read" in out, out


def test_a_holdout_over_a_tenth_of_the_data_is_warned_of_and_printed(tmp_path: Path, caplog) -> None:
    from helpers import make_tar, sample_members

    (tmp_path / "shards").mkdir()
    make_tar(tmp_path / "shards" / "0.tar", sample_members([f"{i:03d}" for i in range(30)]))
    (tmp_path / "c.yaml").write_text(
        "small: {description: d, format: webdataset, location: {root: shards, shards: 0.tar}, loading: {image_size: 32}}\n"
    )
    with caplog.at_level("WARNING"):
        code, out = run("--catalog", str(tmp_path / "c.yaml"), "load", "small", "--workers", "0", "--batch-size", "4")
    assert code == 0, out
    assert "holdout: 16 records (val_batches 4 x batch 4)" in out and "14 train records an epoch" in out, out
    assert "takes 16 of 30 records (53%)" in caplog.text
    code, out = run("--catalog", str(tmp_path / "c.yaml"), "describe", "small")
    assert "holdout: the first val_batches 4 x batch size records" in out, out


def test_count_on_the_core_install_names_the_extra() -> None:
    # The core install has no numpy: make it so in a fresh interpreter.
    code = "import sys; sys.modules['numpy'] = None; from datacat.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", code, "count", "sample"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "pip install 'datacat[images]'" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_describe_of_a_mixture_shows_what_each_components_batches_get(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(
        "a: {description: d, format: webdataset, location: {root: /data/a, shards: '{0..1}.tar'}, loading: {augmentation: none}}\n"
        "b: {description: d, format: webdataset, location: {root: /data/b, shards: '{0..1}.tar'}, loading: {augmentation: flip_only, image_size: 32}}\n"
        "both: {description: d, format: mixture, mixture: {components: [{name: a, weight: 1}, {name: b, weight: 1}]}, loading: {image_size: 64}}\n"
    )
    code, out = run("--catalog", str(tmp_path / "m.yaml"), "describe", "both")
    assert code == 0, out
    # The mixture's image_size applies to both; each keeps its own augmentation (not the entry default).
    assert "a: image_size 64, augmentation none," in out and "b: image_size 64, augmentation flip_only," in out, out


def _subcommands() -> list[str]:
    return sorted(main.commands)


@pytest.mark.parametrize("command", _subcommands())
def test_every_subcommand_help_exits_0(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output


def test_the_cli_imports_and_prints_help() -> None:
    proc = subprocess.run([sys.executable, "-m", "datacat", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "list" in proc.stdout and "convert" in proc.stdout
