"""A job's log: what Beam, dask and their worker processes print goes to a file the summary names.

A Beam job prints its own notices (optional GCP clients it looks for,
flags it discards, its workers' start-up lines), once per worker process.
While a job runs, file descriptor 2 (and so every worker process started
meanwhile) and the root logger write to ``$DATACAT_CACHE/logs/...``;
datacat's own lines (progress, the summary, a real error) still reach the
terminal. ``--verbose`` leaves everything on the terminal instead.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from datacat.cache import cache_dir
from datacat.cli._shared import err

__all__ = ["job_log"]


@contextlib.contextmanager
def job_log(command: str, *, verbose: bool = False) -> Iterator[Path | None]:
    """While the block runs, the libraries' output goes to a new log file (yielded); None with ``verbose``."""
    root = logging.getLogger()
    if verbose:
        if not root.handlers:
            logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        yield None
        return
    folder = cache_dir() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    sys.stderr.flush()
    saved = os.dup(2)
    terminal, previous = None, err.file
    try:
        if _writes_to_fd2(err.file):  # datacat's own lines keep going to the terminal
            terminal = os.fdopen(os.dup(saved), "w", buffering=1, encoding="utf-8")
            err.file = terminal
        with path.open("ab") as log:
            os.dup2(log.fileno(), 2)
        yield path
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if terminal is not None:
            err.file = previous
            terminal.close()
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def _writes_to_fd2(stream: object) -> bool:
    try:
        return isinstance(stream, io.IOBase | io.TextIOWrapper) and stream.fileno() == 2
    except (OSError, ValueError, io.UnsupportedOperation):
        return False
