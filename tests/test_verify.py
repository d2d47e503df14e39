"""`datacat verify`: storage listed once, shards counted against the entry, bad images found, a manifest written."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner
from helpers import make_tar, sample_members

import datacat
from datacat.cli import main


def _dataset(tmp_path: Path) -> Path:
    for shard, n in (("00", 4), ("01", 3), ("02", 4), ("04", 4)):  # 03 is absent, 01 is short
        bad = {f"{shard}x1"} if shard == "02" else set()
        make_tar(tmp_path / f"{shard}.tar", sample_members([f"{shard}x{i}" for i in range(n)], bad=bad))
    (tmp_path / "notes.txt").write_text("kept beside the shards: not reported")
    make_tar(tmp_path / "05-old.tar", sample_members(["old"]))  # a stray shard the entries do not name
    per_shard = ", ".join(f"{s}.tar: 4" for s in ("00", "01", "02", "03", "04"))
    path = tmp_path / "c.yaml"
    path.write_text(
        f"t: {{description: d, format: webdataset, location: {{root: ., shards: '{{00..04}}.tar'}}, totals: {{per_shard: {{{per_shard}}}}}}}\n"
        "g: {description: d, format: webdataset, location: {root: ., shards: '0[0124].tar'}}\n"
    )
    return path


def test_verify_finds_absent_short_unexpected_and_bad(tmp_path: Path) -> None:
    catalog = _dataset(tmp_path)
    result = CliRunner().invoke(main, ["--catalog", str(catalog), "verify", "t", "--deep"])
    assert result.exit_code == 1, result.output
    assert "shard 03.tar is named by the entry but absent" in result.output
    assert "shard 01.tar: holds 3 records, the entry declares 4" in result.output
    assert "05-old.tar in" in result.output and "is not a shard the entry names" in result.output
    assert "notes.txt" not in result.output and "c.yaml" not in result.output
    assert "bad record:" in result.output and "02.tar key 02x1" in result.output
    shallow = CliRunner().invoke(main, ["--catalog", str(catalog), "verify", "t", "--json"])
    report = json.loads(shallow.stdout)
    assert shallow.exit_code == 1 and report["absent"] == ["03.tar"] and report["bad_samples"] == []
    assert {s["name"]: s["records"] for s in report["shards"]} == {"00.tar": 4, "01.tar": 3, "02.tar": 4, "04.tar": 4}
    assert all(s["checksum"].startswith("md5:") for s in report["shards"])


def test_verify_writes_the_manifest_a_glob_entry_then_opens_from(tmp_path: Path, monkeypatch) -> None:
    catalog_path = _dataset(tmp_path)
    catalog = datacat.load_catalog([catalog_path])
    result = CliRunner().invoke(main, ["--catalog", str(catalog_path), "verify", "g", "--deep", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 1 and report["unexpected"] == ["05-old.tar"]
    assert report["problems"][-1].startswith("bad record:") and "02x1" in report["problems"][-1]
    assert report["manifest"] and Path(report["manifest"]).is_file()
    # After verify, the glob is not listed again: resolving sees the manifest's shards and counts.
    import fsspec.implementations.local as local

    def no_listing(*args, **kwargs):
        raise AssertionError("listed storage after verify")

    monkeypatch.setattr(local.LocalFileSystem, "glob", no_listing)
    monkeypatch.setattr(local.LocalFileSystem, "ls", no_listing)
    plan = datacat.resolve("g", catalog=catalog)
    assert [s.name for s in plan.shards] == ["00.tar", "01.tar", "02.tar", "04.tar"]
    assert plan.samples == 15 and plan.samples_exact
    assert datacat.describe("g", catalog=catalog)["shard_count"] == 4
