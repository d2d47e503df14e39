"""A Beam job's own chatter goes to a log file the summary names, not to the terminal (issue 36, defect 4)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
NOISE = ("apitools not found", "semi_persistent_directory", "Discarding unparseable args", "Logging handler created")


def _embed(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
        "DATACAT_CACHE": str(tmp_path / "cache"),
    }
    command = [sys.executable, "-m", "datacat", "embed", "sample", "--fn", "encoders:tiny", "--out"]
    return subprocess.run(
        [*command, str(tmp_path / "emb"), "--workers", "2", *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


@pytest.mark.slow
def test_a_job_prints_its_progress_and_summary_and_logs_beams_lines_to_a_file(tmp_path: Path) -> None:
    done = _embed(tmp_path)
    assert done.returncode == 0, done.stderr
    printed = done.stdout + done.stderr
    assert not [line for line in printed.splitlines() if any(n in line for n in NOISE)], printed
    assert done.stderr.strip() == f"embedding sample with encoders:tiny into {tmp_path / 'emb'}..."
    assert "records embedded │    55" in done.stdout
    (log,) = re.findall(r"^Beam's log: (.+)$", done.stdout, re.MULTILINE)
    text = Path(log).read_text()
    assert "apitools not found" in text and "Discarding unparseable args" in text  # the workers' lines too


@pytest.mark.slow
def test_verbose_leaves_beams_lines_on_the_terminal(tmp_path: Path) -> None:
    done = _embed(tmp_path, "--verbose")
    assert done.returncode == 0, done.stderr
    assert "apitools not found" in done.stderr and "Beam's log" not in done.stdout
