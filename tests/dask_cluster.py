"""A dask.distributed cluster of separate processes on 127.0.0.1: a scheduler and two single-threaded workers.

Started with dask's own command line, as a user would on their hosts
(``dask scheduler``, ``dask worker``), not an in-process LocalCluster:
each worker is a process of its own, so the jobs' functions must pickle,
their ``setup`` runs there, and a worker can be killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
WORKERS = 2


@dataclass(frozen=True)
class DaskCluster:
    """A running cluster: the scheduler's address, its scheduler file, and the processes started."""

    address: str
    scheduler_file: Path
    processes: tuple[subprocess.Popen[bytes], ...]
    kill_marker: Path
    """Written by ``encoders:kills_its_worker_once`` in the worker it kills (holding that worker's pid)."""

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes that run tasks (asked of the workers themselves)."""
        from distributed import Client

        with Client(self.address, timeout=30) as client:
            return sorted(client.run(os.getpid).values())

    def wait_for_workers(self, n: int = WORKERS, timeout: float = 120) -> None:
        """Waits until ``n`` workers are connected (after a start, or after one was killed and came back)."""
        from distributed import Client

        with Client(self.address, timeout=30) as client:
            client.wait_for_workers(n, timeout=timeout)


def _dask(*args: str, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as output:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "distributed.cli." + args[0], *args[1:]],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped whole at the end
        )


@pytest.fixture(scope="module", name="dask_cluster")
def dask_cluster_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskCluster]:
    """A scheduler and two worker processes (``--nworkers 1 --nthreads 1`` each) for the module's tests."""
    folder = tmp_path_factory.mktemp("dask")
    scheduler_file = folder / "scheduler.json"
    root = str(TESTS.parent)
    env = {
        **os.environ,
        # The workers import datacat from this checkout and the tests' encoders (``--fn encoders:tiny``).
        "PYTHONPATH": os.pathsep.join([root, str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
        "DATACAT_CACHE": str(folder / "cache"),
        "DATACAT_TEST_KILL_MARKER": str(folder / "killed"),  # encoders:kills_its_worker_once
    }
    processes = [
        _dask(
            "dask_scheduler",
            "--host=127.0.0.1",
            "--port=0",
            "--dashboard-address=:0",
            f"--scheduler-file={scheduler_file}",
            log=folder / "scheduler.log",
            env=env,
        )
    ]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() or not scheduler_file.read_text().strip():
            if time.monotonic() > deadline or processes[0].poll() is not None:
                raise RuntimeError(f"the dask scheduler did not start: {(folder / 'scheduler.log').read_text()}")
            time.sleep(0.2)
        address = json.loads(scheduler_file.read_text())["address"]
        for i in range(WORKERS):
            processes.append(
                _dask(
                    "dask_worker",
                    address,
                    "--nworkers=1",
                    "--nthreads=1",
                    "--no-dashboard",
                    f"--local-directory={folder / f'worker{i}'}",
                    log=folder / f"worker{i}.log",
                    env=env,
                )
            )
        cluster = DaskCluster(address, scheduler_file, tuple(processes), folder / "killed")
        cluster.wait_for_workers()
        yield cluster
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
