"""Both backends over the sample data: exactly once across ranks and workers, determinism, resume.

jax is only ever imported in subprocesses (tests/harness.py): forked torch
workers beside a loaded jax risk deadlock, so the two never share a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import datacat

pytestmark = pytest.mark.slow  # every test here starts processes or a storage server

HARNESS = Path(__file__).parent / "harness.py"
FORMATS = ("sample", "sample-arrayrecord")
ALL_KEYS = 55


def run_ranks(
    framework: str, loads_for_rank: list[list[dict[str, Any]]], timeout: int = 400, env: dict[str, str] | None = None
) -> list[list[dict[str, Any]]]:
    """Starts one process per rank, all at once; returns each rank's results."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    procs = [
        subprocess.Popen(
            [sys.executable, str(HARNESS), json.dumps({"framework": framework, "loads": loads})],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for loads in loads_for_rank
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-3000:]
        line = next(line for line in out.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT ") :]))
    return results


def run_script(path: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Writes ``code`` to ``path`` and runs it as a user's script, in a fresh interpreter."""
    path.write_text(code)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, check=False, env=env
    )


# (ranks, workers) layouts up to 4 x 2; the sample has 3 shards, fewer than 2 x 2 or 4 x 2. jax's spawned
# worker pools start slowly (each imports jax again): it takes one process alone and 2 x 2.
LAYOUTS = {"torch": [(1, 0), (2, 1), (3, 2), (4, 2)], "jax": [(1, 0), (2, 2)]}


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_exactly_once_and_equal_batches_across_ranks_and_workers(framework: str) -> None:
    layouts = LAYOUTS[framework]
    max_ranks = max(r for r, _ in layouts)
    loads_for_rank: list[list[dict[str, Any]]] = [[] for _ in range(max_ranks)]
    index = []
    for name in FORMATS:
        for ranks, workers in layouts:
            for rank in range(ranks):
                loads_for_rank[rank].append(
                    {
                        "name": name,
                        "batch_size": 4,
                        "rank": rank,
                        "world_size": ranks,
                        "num_workers": workers,
                        "seed": 3,
                    }
                )
            index.append((name, ranks, workers))
    results = run_ranks(framework, loads_for_rank)
    cursor = [0] * max_ranks
    for name, ranks, workers in index:
        per_rank = []
        for rank in range(ranks):
            per_rank.append(results[rank][cursor[rank]])
            cursor[rank] += 1
        keys = [k for r in per_rank for batch in r["batches"] for k in batch]
        counts = {len(r["batches"]) for r in per_rank}
        assert len(keys) == ALL_KEYS and len(set(keys)) == ALL_KEYS, (name, ranks, workers, sorted(keys))
        assert len(counts) == 1, f"{name} {ranks}x{workers}: ranks got {counts} batches"
        assert all(len(batch) > 0 for r in per_rank for batch in r["batches"])


def _torch_run(name: str, **options: Any) -> tuple[list[str], dict[str, str]]:
    result = run_load_here("torch", {"name": name, "batch_size": 8, **options})
    return [k for batch in result["batches"] for k in batch], result["pixels"]


def run_load_here(framework: str, load: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(HARNESS.parent))
    from harness import run_load

    return run_load(framework, load)


@pytest.mark.parametrize("name", FORMATS)
def test_torch_and_jax_agree_on_keys_and_pixels(name: str) -> None:
    load = {"name": name, "batch_size": 8, "epochs": 2, "seed": 5, "num_workers": 0}
    (jax_result,) = run_ranks("jax", [[load]])[0]
    torch_result = run_load_here("torch", load)
    # The same Plan and seed: the same records each epoch, and the same pixels for the same record.
    for epoch in (0, 1):
        jax_keys = {k.split(":")[1] for k in jax_result["pixels"] if k.startswith(f"{epoch}:")}
        torch_keys = {k.split(":")[1] for k in torch_result["pixels"] if k.startswith(f"{epoch}:")}
        assert jax_keys == torch_keys and len(jax_keys) == ALL_KEYS
    assert jax_result["pixels"] == torch_result["pixels"]
    assert jax_result["batches"] == torch_result["batches"]  # one schedule: the same order too


def test_determinism_reshuffle_and_worker_count() -> None:
    keys, pixels = _torch_run("sample-arrayrecord", seed=1, epochs=2)
    again, pixels_again = _torch_run("sample-arrayrecord", seed=1, epochs=2)
    assert keys == again and pixels == pixels_again
    two_workers, pixels_two = _torch_run("sample-arrayrecord", seed=1, epochs=2, num_workers=2)
    assert two_workers == keys and pixels_two == pixels  # random access: any worker count
    first, second = keys[:ALL_KEYS], keys[ALL_KEYS:]
    assert sorted(first) == sorted(second) and first != second  # each epoch all records, reshuffled
    other, _ = _torch_run("sample-arrayrecord", seed=2)
    assert other != first
    unshuffled, _ = _torch_run("sample-arrayrecord", shuffle=False)
    assert unshuffled == sorted(unshuffled)
    stream, stream_pixels = _torch_run("sample", seed=1, num_workers=2)
    assert _torch_run("sample", seed=1, num_workers=2) == (stream, stream_pixels)


def _resume_case(framework: str, name: str, workers: int, ks: list[int], *, stop: bool = True) -> None:
    """Resumes after each of ``ks`` batches in a new process: from a loop left there (``stop``), or from
    checkpoints taken while one run went on (one worker start instead of one a stop)."""
    base = {"name": name, "batch_size": 8, "epochs": 2, "seed": 9, "num_workers": workers}
    if stop:
        loads = [dict(base)] + [{**base, "stop_after": k} for k in ks]
        (full, *stopped) = run_ranks(framework, [loads])[0]
        states = [s["state"] for s in stopped]
    else:
        (full,) = run_ranks(framework, [[{**base, "states_at": ks}]])[0]
        states = full["states"]
    resumed = run_ranks(framework, [[{**base, "state": state} for state in states]])[0]
    per_epoch = full["per_epoch"]
    for k, rest in zip(ks, resumed, strict=True):
        assert full["batches"][:k] + rest["batches"] == full["batches"], (
            f"{framework} {name} k={k} (epoch length {per_epoch})"
        )
        assert {key: full["pixels"][key] for key in rest["pixels"]} == rest["pixels"]


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_resume_in_a_new_process_continues_exactly(framework: str) -> None:
    # 7 batches an epoch: k = 7 is the epoch boundary, 9 is inside the second epoch. Each stop and
    # resume is a loader whose workers start again (grain spawns them: ~4 s each), so jax, whose random
    # access resume is only where its run starts, resumes from checkpoints taken during one run, one in
    # each epoch, the stream format's from both sides of the epoch boundary.
    if framework == "torch":
        _resume_case(framework, "sample-arrayrecord", 2, [1, 3, 7, 9])
        _resume_case(framework, "sample", 2, [2, 7, 10])
    else:
        _resume_case(framework, "sample-arrayrecord", 2, [3, 9], stop=False)
        _resume_case(framework, "sample", 2, [2, 7, 10], stop=False)


def test_state_from_another_plan_is_refused() -> None:
    loader = datacat.open("sample-arrayrecord", framework="torch", batch_size=8, seed=1)
    iterator = iter(loader)
    next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    other = datacat.open("sample-arrayrecord", framework="torch", batch_size=8, seed=2)
    with pytest.raises(datacat.errors.PlanMismatch, match="fingerprint"):
        other.load_state_dict(state)
    other.load_state_dict(state, allow_other_plan=True)
    assert other.batch == 1
    # Another world size: the epoch goes on where every rank was (tests/test_elastic.py); another batch
    # size would move the holdout (val_batches x batch_size) and is refused.
    wider = datacat.open("sample-arrayrecord", framework="torch", batch_size=8, seed=1, world_size=2, rank=0)
    wider.load_state_dict(state)
    assert wider.batch == 0 and wider.schedule.first == state["position"] == 8
    larger = datacat.open("sample-arrayrecord", framework="torch", batch_size=4, seed=1, val_batches=2)
    with pytest.raises(datacat.errors.PlanMismatch, match="fingerprint"):
        larger.load_state_dict(state)


def test_holdout_never_in_training_and_drop_remainder() -> None:
    train, _ = _torch_run("sample-arrayrecord", val_batches=2)
    held = run_load_here(
        "torch", {"name": "sample-arrayrecord", "batch_size": 8, "val_batches": 2, "split": "validation"}
    )
    held_keys = [k for b in held["batches"] for k in b]
    assert len(held_keys) == 16 and not set(held_keys) & set(train) and len(train) == ALL_KEYS - 16
    dropped = run_load_here("torch", {"name": "sample-arrayrecord", "batch_size": 8, "drop_remainder": True})
    assert [len(b) for b in dropped["batches"]] == [8] * 6


def test_image_layouts_and_bad_samples_in_workers(tmp_path: Path) -> None:
    import torch
    from helpers import make_tar, sample_members

    batch = next(iter(datacat.open("sample", framework="torch", batch_size=4, image_layout="chw_float")))
    assert batch["image"].shape == (4, 3, 64, 64) and batch["image"].dtype == torch.float32
    assert float(batch["image"].min()) >= -1.0 and float(batch["image"].max()) <= 1.0
    keys = [f"{i:04d}" for i in range(10)]
    make_tar(tmp_path / "0.tar", sample_members(keys, bad={"0003", "0007"}))
    (tmp_path / "c.yaml").write_text(
        "t: {description: d, format: webdataset, location: {root: ., shards: 0.tar}, totals: {per_shard: {0.tar: 10}}, loading: {val_batches: 0}}\n"
    )
    catalog = datacat.load_catalog([tmp_path / "c.yaml"])
    loader = datacat.open(
        "t",
        framework="torch",
        batch_size=4,
        catalog=catalog,
        image_size=16,
        num_workers=2,
        on_bad_sample="skip",
        bad_sample_budget=0.5,
    )
    got = [k for b in loader for k in b["key"]]
    assert sorted(got) == [k for k in keys if k not in {"0003", "0007"}]
    assert sorted(b.key for b in loader.ledger.skipped) == ["0003", "0007"]
    strict = datacat.open("t", framework="torch", batch_size=4, catalog=catalog, image_size=16, num_workers=2)
    with pytest.raises(datacat.errors.RecordError, match=r"0\.tar, key 000[37]: not a readable image"):
        list(strict)


def test_load_command_with_grid(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from datacat.cli import main

    grid = tmp_path / "grid.png"
    result = CliRunner().invoke(
        main, ["load", "sample", "--framework", "torch", "--batch-size", "8", "--workers", "0", "--grid", str(grid)]
    )
    assert result.exit_code == 0, result.output
    assert "image: torch (8, 64, 64, 3) torch.uint8" in result.output and "no bad samples" in result.output
    assert "images/s" in result.output
    from PIL import Image

    with Image.open(grid) as sheet:
        pixels = np.asarray(sheet.convert("RGB"))
    assert sheet.size[0] >= 8 * 100 and pixels.std() > 20  # photos, not a blank sheet


def test_jax_arrays_laid_out_over_local_devices() -> None:
    # Two CPU devices stand in for a host's accelerators.
    load = {"name": "sample-arrayrecord", "batch_size": 8, "device_put": True, "drop_remainder": True}
    (result,) = run_ranks("jax", [[load]], env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})[0]
    assert result["arrays"] and all(
        a == {"type": "ArrayImpl", "shape": [8, 64, 64, 3], "devices": 2} for a in result["arrays"]
    )
    assert len(result["batches"]) == 6


def test_loader_errors_are_clear() -> None:
    with pytest.raises(datacat.OptionError, match="cannot fill one batch of 64 on each of 4"):
        datacat.open("sample", framework="torch", batch_size=64, world_size=4, rank=0, drop_remainder=True)
    with pytest.raises(datacat.OptionError, match="unknown framework"):
        datacat.open("sample", framework="tf", batch_size=4)
    sample = datacat.load_catalog()["sample"]
    bare = sample.model_copy(update={"totals": sample.totals.model_copy(update={"per_shard": None, "samples": None})})
    catalog = datacat.Catalog({"bare": bare}, {"bare": datacat.load_catalog().sources["sample"]})
    # Without per_shard the tars are indexed (counted) at open, and load.
    keys = [k for b in datacat.open("bare", framework="torch", batch_size=4, catalog=catalog) for k in b["key"]]
    assert len(keys) == 55 and len(set(keys)) == 55


def test_image_folder_and_list_through_both_frameworks(tmp_path: Path) -> None:
    from helpers import jpeg

    (tmp_path / "imgs").mkdir()
    for i in range(10):
        (tmp_path / "imgs" / f"{i:02d}.jpg").write_bytes(jpeg(i))
        (tmp_path / "imgs" / f"{i:02d}.txt").write_text(f"picture {i}")
    (tmp_path / "list.csv").write_text("path,text\n" + "".join(f"imgs/{i:02d}.jpg,listed {i}\n" for i in range(10)))
    (tmp_path / "c.yaml").write_text(
        "folder: {description: d, format: image_folder, location: {root: ., shards: [imgs]}, record: {layout: files}, loading: {image_size: 16, val_batches: 0}}\n"
        "table: {description: d, format: image_list, location: {root: ., shards: [list.csv]}, record: {layout: table, image: path, caption: text}, loading: {image_size: 16, val_batches: 0}}\n"
    )
    catalog = datacat.load_catalog([tmp_path / "c.yaml"])
    loads = [{"name": n, "batch_size": 4, "num_workers": 1, "seed": 2} for n in ("folder", "table")]
    jax_results = run_ranks("jax", [loads], env={"DATACAT_CATALOG": str(tmp_path / "c.yaml")})[0]
    for load, jax_result in zip(loads, jax_results, strict=True):
        torch_batches = [
            list(b["key"])
            for b in datacat.open(load["name"], framework="torch", batch_size=4, num_workers=1, seed=2, catalog=catalog)
        ]
        assert torch_batches == jax_result["batches"]
        assert (
            sorted(k for b in torch_batches for k in b) == sorted({k for b in torch_batches for k in b})
            and sum(map(len, torch_batches)) == 10
        )


def test_endless_epochs_and_unpicklable_tokenize() -> None:
    loader = datacat.open("sample-arrayrecord", framework="torch", batch_size=8, epochs=None)
    iterator = iter(loader)
    keys = [k for _ in range(20) for k in next(iterator)["key"]]  # 7 batches an epoch: into the third
    assert loader.epoch == 2 and len(keys) == 2 * ALL_KEYS + 6 * 8
    assert sorted(keys[:ALL_KEYS]) == sorted(keys[ALL_KEYS : 2 * ALL_KEYS])
    # Forked workers take any tokenize; workers that are not forked need it picklable, and say so.
    forked = datacat.open(
        "sample",
        framework="torch",
        batch_size=4,
        num_workers=2,
        tokenize=lambda text: text.split(),
        multiprocessing_context="fork",  # this process has read ArrayRecords above: the default would be forkserver
    )
    assert next(iter(forked))["tokens"][0]
    spawned = datacat.open(
        "sample", framework="torch", batch_size=4, num_workers=2, tokenize=lambda t: t, multiprocessing_context="spawn"
    )
    with pytest.raises(datacat.OptionError, match="cannot be pickled to worker processes that are not forked"):
        next(iter(spawned))
    tokens = next(iter(datacat.open("sample", framework="torch", batch_size=4, num_workers=2, tokenize=str.split)))
    assert isinstance(tokens["tokens"][0], list) and tokens["tokens"][0]


def test_missing_and_short_shards_are_clear_errors(tmp_path: Path) -> None:
    from helpers import make_tar, sample_members

    for framework_name in ("sample", "sample-arrayrecord"):
        with pytest.raises(FileNotFoundError, match=r"shard not found: .*empty.*; check the entry's root") as info:
            list(
                datacat.open(
                    framework_name, framework="torch", batch_size=8, num_workers=2, root=str(tmp_path / "empty")
                )
            )
        assert "Errno 2] [Errno" not in str(info.value)
    make_tar(tmp_path / "0.tar", sample_members([f"{i:02d}" for i in range(6)]))
    (tmp_path / "c.yaml").write_text(
        "short: {description: d, format: webdataset, location: {root: ., shards: 0.tar}, totals: {per_shard: {0.tar: 9}}, loading: {val_batches: 0}}\n"
    )
    # The tar is indexed when opened: a short shard is refused before the first batch.
    with pytest.raises(datacat.ShardError, match=r"0\.tar holds 6 samples, the catalog declares 9"):
        datacat.open(
            "short", framework="torch", batch_size=3, catalog=datacat.load_catalog([tmp_path / "c.yaml"]), image_size=16
        )


def test_missing_shard_under_grain_workers_is_a_clear_error(tmp_path: Path) -> None:
    code = (
        "import datacat\n"
        "if __name__ == '__main__':\n"
        "    try:\n"
        f"        list(datacat.open('sample', framework='jax', batch_size=8, num_workers=2, root={str(tmp_path)!r}))\n"
        "    except FileNotFoundError as exc:\n"
        "        print('CAUGHT', exc)\n"
    )
    done = run_script(tmp_path / "probe.py", code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CAUGHT [Errno 2] shard not found:" in done.stdout and "check the entry's root" in done.stdout


def test_script_without_main_guard_runs_torch_workers(tmp_path: Path) -> None:
    # Torch users on Linux rarely guard their scripts: forked workers must not need it.
    done = run_script(
        tmp_path / "train.py",
        "import datacat\n"
        "loader = datacat.open('sample-arrayrecord', framework='torch', batch_size=8, num_workers=2)\n"
        "print('RECORDS', sum(len(b['key']) for b in loader))\n",
    )
    assert done.returncode == 0 and "RECORDS 55" in done.stdout, done.stderr[-2000:]


def _worker_environment(caption: str) -> str:
    return os.environ.get("DATACAT_TEST_LATE_VARIABLE", "unset")


def test_forkserver_workers_see_the_loaders_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # A forkserver keeps the environment it started with; a variable set later (a storage endpoint,
    # a credential) must still reach the workers, or they talk to the wrong place.
    def first_tokens() -> list[Any]:
        loader = datacat.open(
            "sample",
            framework="torch",
            batch_size=4,
            num_workers=2,
            tokenize=_worker_environment,
            multiprocessing_context="forkserver",
        )
        return list(next(iter(loader))["tokens"])

    first_tokens()  # starts the forkserver
    monkeypatch.setenv("DATACAT_TEST_LATE_VARIABLE", "set after the server started")
    assert set(first_tokens()) == {"set after the server started"}


def test_workers_fork_unless_they_read_array_records_after_this_process_did(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from helpers import make_array_record

    from datacat.backends import torch as backend

    mixtures = datacat.load_catalog([Path(__file__).parent / "catalogs" / "valid" / "mixtures.yaml"])
    tars, records = datacat.resolve("sample"), datacat.resolve("sample-arrayrecord")
    mixed = datacat.resolve("mix", catalog=mixtures)  # sample tars and sample ArrayRecords
    import array_record.python  # the package alone: no C++

    # As in a fresh process: the C++ module not loaded (earlier tests here have loaded it).
    monkeypatch.delitem(sys.modules, "array_record.python.array_record_module", raising=False)
    monkeypatch.delattr(array_record.python, "array_record_module", raising=False)
    assert all(backend._worker_context(plan) is None for plan in (tars, records, mixed))
    # Opening a loader loads no C++ client here: only a read or a write does.
    datacat.open(records, framework="torch", batch_size=4, num_workers=2)
    assert backend._worker_context(records) is None
    make_array_record(tmp_path / "written.ar", [b"x"])  # a write, not a read, makes a forked reader crash
    # A tar loader's workers never touch array_record's half-alive client: they fork, starting in milliseconds.
    assert backend._worker_context(tars) is None
    assert backend._worker_context(records).get_start_method() == "forkserver"
    assert backend._worker_context(mixed).get_start_method() == "forkserver"


def _stuck(caption: str) -> str:
    import time

    time.sleep(30)
    return caption


def test_a_stuck_worker_is_an_error_not_a_hang() -> None:
    loader = datacat.open(
        "sample",
        framework="torch",
        batch_size=4,
        num_workers=1,
        tokenize=_stuck,
        multiprocessing_context="fork",
        worker_timeout=1,
    )
    with pytest.raises(datacat.DatacatError, match=r"no batch came from the worker processes in 1 s"):
        next(iter(loader))


def test_open_a_plan_with_options() -> None:
    plan = datacat.resolve("sample-arrayrecord", seed=1)
    keys = lambda loader: [k for b in loader for k in b["key"]]  # noqa: E731
    five = keys(datacat.open(plan, framework="torch", batch_size=8, seed=5))
    assert five == keys(datacat.open("sample-arrayrecord", framework="torch", batch_size=8, seed=5))
    assert five != keys(datacat.open(plan, framework="torch", batch_size=8))  # the Plan's own seed, 1
    with pytest.raises(datacat.OptionError, match="image_size"):
        datacat.open(plan, framework="torch", batch_size=8, image_size=-3)
    with pytest.raises(datacat.OptionError, match="split decide which Plan is built"):
        datacat.open(plan, framework="torch", batch_size=8, split="validation")


PERSISTENT_WORKERS = """
import json, os, sys, time
import datacat

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenized.log")

def worker_pid(caption):
    with open(LOG, "a") as log:  # one line per sample transformed, by any process
        log.write(caption.replace(chr(10), " ") + chr(10))
    if str(os.getpid()) == os.environ.get("TEST_MAIN_PID"):  # a first batch built here, while workers are slow to start
        print("HEAD WHILE WORKERS", len(worker_processes()), flush=True)
    return os.getpid()

def worker_processes():
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                command = cmdline.read()
        except (OSError, IndexError, ValueError):
            continue
        if parent == os.getpid() and (b"spawn_main" in command or b"forkserver" in command):
            found.append(pid)
    return found

if __name__ == "__main__":
    framework, epochs = sys.argv[1], int(sys.argv[2])
    os.environ["TEST_MAIN_PID"] = str(os.getpid())
    loader = datacat.open("sample-arrayrecord", framework=framework, batch_size=4, num_workers=2, seed=1,
                          epochs=epochs or None, tokenize=worker_pid)
    pids = {}
    for batch in loader:
        pids.setdefault(loader.epoch, set()).update(batch["tokens"])
        if not epochs:
            print("WORKERS", json.dumps(sorted(pids[0])), flush=True)
            time.sleep(120)
        if loader.epoch == 0 and loader.batch == len(loader) - 1:  # the last batch of epoch 0 not yet taken
            time.sleep(1)
            with open(LOG) as log:
                print("AHEAD", sum(1 for _ in log), flush=True)
    print("PIDS", json.dumps({e: sorted(p) for e, p in pids.items()}), os.getpid())
"""


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_workers_live_across_epochs(framework: str, tmp_path: Path) -> None:
    script = tmp_path / "epochs.py"
    script.write_text(PERSISTENT_WORKERS)
    done = subprocess.run(
        [sys.executable, str(script), framework, "3"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PIDS "))
    pids, main = line[len("PIDS ") :].rsplit(" ", 1)
    per_epoch = json.loads(pids)
    assert sorted(per_epoch) == ["0", "1", "2"]
    # The first batch may come from the loader's own process, built while slow-starting workers boot.
    workers = {e: set(p) - {int(main)} for e, p in per_epoch.items()}
    assert all(p == workers["0"] for p in workers.values()), per_epoch  # no worker started again
    assert len(workers["0"]) == 2 and int(main) not in per_epoch["1"] + per_epoch["2"], per_epoch
    # While the last batch of epoch 0 waited to be taken, the workers went on into epoch 1 (no drain
    # between epochs, which would leave a core idle at every epoch's end).
    ahead = int(next(line for line in done.stdout.splitlines() if line.startswith("AHEAD ")).split()[1])
    assert ahead > ALL_KEYS, f"{ahead} samples built by then: the workers waited for the epoch to end"
    # grain's spawned workers boot (importing jax) only once the first batch is built here: booting
    # beside it, they would slow it down. Forked torch workers start at once, so nothing is built here.
    booting = [int(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("HEAD WHILE WORKERS")]
    assert booting == ([0] * 4 if framework == "jax" else []), booting


def shm_mapping(address: int) -> str:
    """The file mapped at ``address`` in this process (a slot: ``/dev/shm/dc...``, unlinked once mapped)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(end, 16) for end in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def test_torch_workers_fill_a_batch_array_again_only_once_the_loop_dropped_it() -> None:
    import torch

    from datacat.backends.batch_memory import SLOTS

    def slot(batch: dict[str, Any]) -> str:  # the worker's shared-memory slot under the batch's pixels
        name = shm_mapping(batch["image"].data_ptr())
        assert name.startswith("/dev/shm/dc"), f"the batch's pixels are not in a slot: {name!r}"
        return name

    options: dict[str, Any] = {"framework": "torch", "batch_size": 4, "epochs": 3, "seed": 2}
    reference = [batch["image"].clone() for batch in datacat.open("sample", **options)]
    assert len(reference) > 2 * SLOTS + 2

    held = list(datacat.open("sample", num_workers=2, **options))  # every batch kept: none may be filled again
    assert all(torch.equal(a["image"], b) for a, b in zip(held, reference, strict=True))
    assert len({slot(batch) for batch in held[: 2 * SLOTS]}) == 2 * SLOTS  # then all are held: fresh memory
    del held

    loader = datacat.open("sample", num_workers=2, **options)
    start, files = loader.state_dict(), set()
    for _ in range(3):  # runs left early and started again: the slots of batches on their way come back
        loader.load_state_dict(start)
        files.update(slot(batch) for _, batch in zip(range(3), loader, strict=False))
    assert loader._slots is not None
    table = loader._slots.name.lstrip("/")
    loader.load_state_dict(start)
    for batch, expected in zip(loader, reference, strict=True):  # each dropped before the next is taken
        assert torch.equal(batch["image"], expected)
        files.add(slot(batch))
    assert len(files) <= 2 * SLOTS, f"{len(files)} arrays for {len(reference) + 9} batches: not filled again"
    loader.close()  # the workers stop, then their slots' names go (other tests' loaders may still hold theirs)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(table)]


JAX_SLOTS = """
import hashlib, json, os
import datacat

def digest(batch):
    return hashlib.md5(batch["image"].tobytes()).hexdigest()

def mapping(array):  # the memory under an array: its owner, or the mmap under a memoryview
    while array.base is not None and not isinstance(array.base, memoryview):
        array = array.base
    return array if array.base is None else array.base.obj

if __name__ == "__main__":
    options = dict(framework="jax", batch_size=4, epochs=3, seed=2)
    reference = [digest(batch) for batch in datacat.open("sample-arrayrecord", **options)]
    held = list(datacat.open("sample-arrayrecord", num_workers=2, **options))  # none may be filled again
    loader = datacat.open("sample-arrayrecord", num_workers=2, **options)
    digests, mappings = [], []
    for batch in loader:  # each dropped before the next is taken
        digests.append(digest(batch))
        mappings.append(mapping(batch["image"]))  # kept, so ids stay unique
    loader.close()  # the workers stop in a thread once the last epoch is delivered: this waits for them
    left = [name for name in os.listdir("/dev/shm") if name.startswith(f"dc{os.getpid():x}")]
    print("RESULT", json.dumps({"batches": len(reference), "held": [digest(b) for b in held] == reference,
                                "dropped": digests == reference, "memory": len({id(m) for m in mappings}), "left": left}))
"""


def test_jax_workers_fill_a_batch_array_again_only_once_the_loop_dropped_it(tmp_path: Path) -> None:
    from datacat.backends.batch_memory import SLOTS

    done = run_script(tmp_path / "slots.py", JAX_SLOTS)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["batches"] > 2 * SLOTS + 2 and result["held"] and result["dropped"], result
    # +1: the first batch, built in this process while the workers start.
    assert result["memory"] <= 2 * SLOTS + 1, (
        f"{result['memory']} arrays for {result['batches']} batches: not filled again"
    )
    assert result["left"] == [], result
    assert "leaked" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]


LEFT_MID_EPOCH = """
import sys
import datacat
def first_keys(name, framework, workers):
    # A loader dropped unclosed, its loop left early: it stops its workers and frees their memory itself.
    loader = datacat.open(name, framework=framework, batch_size=4, num_workers=workers, seed=1)
    for step, batch in enumerate(loader):
        if step == 1:
            return list(batch["key"])
if __name__ == "__main__":
    framework, workers = sys.argv[1], int(sys.argv[2])
    assert len(first_keys("sample-arrayrecord", framework, workers)) == 4
    loader = datacat.open("sample-arrayrecord", framework=framework, batch_size=4, num_workers=workers, seed=1)
    for step, batch in enumerate(loader):
        if step == 2:
            break  # a loop left early: its iterator stays suspended until exit
    image = batch["image"]
    started = iter(datacat.open("sample", framework=framework, batch_size=4, num_workers=workers, seed=1))
    next(started)  # grain's workers are still starting
    print("LEFT", type(image).__name__, tuple(image.shape), int(image.sum()) > 0, flush=True)
"""


@pytest.mark.parametrize(("framework", "workers"), [("torch", 0), ("jax", 2)])
def test_a_script_that_exits_mid_epoch_prints_nothing_more(framework: str, workers: int, tmp_path: Path) -> None:
    # Unclosed loaders are closed at exit while the modules are whole: no "Exception ignored" traceback
    # from the iterators' cleanup at teardown, no shared memory left for the resource tracker to report;
    # one dropped before exit frees its workers' shared memory then.
    script = tmp_path / "left.py"
    script.write_text(LEFT_MID_EPOCH)
    done = subprocess.run(
        [sys.executable, str(script), framework, str(workers)], capture_output=True, text=True, timeout=300
    )
    # A batch from grain's workers is a plain array (its own mapping of the segment), still whole.
    kind = "Tensor" if framework == "torch" else "ndarray"
    assert done.returncode == 0 and done.stdout.split() == ["LEFT", kind, "(4,", "64,", "64,", "3)", "True"], (
        done.stdout + done.stderr[-3000:]
    )
    assert "Traceback" not in done.stderr and "leaked" not in done.stderr, done.stderr[-3000:]


def test_grain_workers_build_few_batches_ahead_and_exit_when_their_parent_is_killed(tmp_path: Path) -> None:
    import signal
    import time

    script = tmp_path / "train.py"
    script.write_text(PERSISTENT_WORKERS)
    proc = subprocess.Popen(
        [sys.executable, str(script), "jax", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert proc.stdout is not None
        line = next(line for line in proc.stdout if line.startswith("WORKERS "))
        workers = json.loads(line.split(" ", 1)[1])
        assert workers and all(Path(f"/proc/{pid}").exists() for pid in workers)
        # While the loop sleeps after its first batch, the workers build a few batches ahead and wait:
        # 5 a worker, 1 built here while they start and 1 asked of them meanwhile, 12 batches of 4 in all.
        # grain's reader alone would go on for 500 batches a worker.
        log, counts = tmp_path / "tokenized.log", [0]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (counts[-1] <= 4 or counts[-1] != counts[-4]):  # workers up, 1.5 s still
            time.sleep(0.5)
            counts.append(len(log.read_text().splitlines()))
        assert counts[-1] <= 4 * 14, f"{counts[-1]} samples built for 1 batch taken: the workers ran ahead"
        assert shared_memory_of(proc.pid), "no slot table in /dev/shm: the workers' batches are not in slots"
    finally:
        proc.send_signal(signal.SIGKILL)  # as the OOM killer or a preempted job does: no cleanup runs
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in workers):
        time.sleep(0.2)
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()]
    assert not alive, f"grain workers {alive} outlived their killed parent"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and shared_memory_of(proc.pid):
        time.sleep(0.2)  # the resource tracker unlinks what the family left once its last process is gone
    assert not shared_memory_of(proc.pid), shared_memory_of(proc.pid)


def shared_memory_of(pid: int) -> list[str]:
    """The names in /dev/shm of a loader's slot table and its workers' slots (batch_memory.Slots)."""
    return [name for name in os.listdir("/dev/shm") if name.startswith(f"dc{pid:x}")]


IN_PROCESS_AHEAD = """
import os, time
import datacat

LOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "built.log")

def logged(caption):
    with open(LOG, "a") as log:
        log.write(chr(10))
    return 0

if __name__ == "__main__":
    loader = datacat.open("sample-arrayrecord", framework="jax", batch_size=4, epochs=None, seed=1, tokenize=logged)
    next(iter(loader))
    time.sleep(1.5)  # a training step slower than loading
    with open(LOG) as log:
        print("BUILT", len(log.read()), flush=True)
"""


def test_jax_without_workers_builds_two_batches_ahead(tmp_path: Path) -> None:
    done = run_script(tmp_path / "ahead.py", IN_PROCESS_AHEAD)
    assert done.returncode == 0, done.stderr[-3000:]
    built = int(next(line for line in done.stdout.splitlines() if line.startswith("BUILT ")).split()[1])
    assert built <= 4 * 3, f"{built} samples built for 1 batch taken: grain's reader ran ahead (500 batches by default)"


def test_unguarded_script_with_grain_workers_gets_one_clear_error(tmp_path: Path) -> None:
    # grain spawns its workers, which run an unguarded script's top level again: say so, briefly.
    done = run_script(
        tmp_path / "train.py",
        "import datacat\n"
        "loader = datacat.open('sample-arrayrecord', framework='jax', batch_size=8, num_workers=2)\n"
        "print('RECORDS', sum(len(b['key']) for b in loader))\n",
    )
    assert done.returncode != 0 and "RECORDS" not in done.stdout
    assert 'under `if __name__ == "__main__":`' in done.stderr, done.stderr[-3000:]
    assert "OptionError" in done.stderr and len(done.stderr.splitlines()) < 30, done.stderr


def _probe(tmp_path: Path, code: str, framework: str, prefix: str) -> list[Any]:
    """Runs ``code`` as a script over tmp_path/c.yaml in ``framework``; the JSON after each ``prefix`` line."""
    script = tmp_path / "probe.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "c.yaml"), framework],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    found = [json.loads(line[len(prefix) :]) for line in done.stdout.splitlines() if line.startswith(prefix)]
    return found or [done.stdout + done.stderr[-3000:]]  # the output, to show why, when nothing came


ERROR_PROBE = """
import json, sys
import datacat
if __name__ == "__main__":
    catalog = datacat.load_catalog([sys.argv[1]])
    for name in ("damaged", "absent"):
        try:
            list(datacat.open(name, framework=sys.argv[2], batch_size=4, num_workers=2, catalog=catalog, image_size=16))
        except Exception as exc:
            print("ERROR", json.dumps([name, type(exc).__name__, getattr(exc, "url", None), getattr(exc, "filename", None)]))
"""


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_errors_from_workers_keep_their_class_and_attributes(framework: str, tmp_path: Path) -> None:
    from helpers import make_array_record

    from datacat.formats.packed import pack_record

    folder = tmp_path / "ar"
    folder.mkdir()
    for shard in range(2):
        make_array_record(folder / f"{shard}.ar", [pack_record({"jpg": b"x", "txt": "c"}) for _ in range(4)])
    (folder / "1.ar").write_bytes(b"\0" * 5000)  # not an ArrayRecord: found when a worker opens it
    (tmp_path / "c.yaml").write_text(
        "damaged: {description: d, format: array_record, location: {root: ar, shards: '{0..1}.ar'}, "
        "totals: {per_shard: {0.ar: 4, 1.ar: 4}}, record: {layout: packed}, loading: {val_batches: 0}}\n"
        "absent: {description: d, format: array_record, location: {root: ar, shards: '{0..2}.ar'}, "
        "totals: {per_shard: {0.ar: 4, 1.ar: 4, 2.ar: 4}}, record: {layout: packed}, loading: {val_batches: 0}}\n"
    )
    errors = _probe(tmp_path, ERROR_PROBE, framework, "ERROR ")
    assert len(errors) == 2, errors
    damaged, absent = errors
    assert damaged[1] == "ShardError" and damaged[2].endswith("/ar/1.ar"), damaged
    assert absent[1] in ("FileNotFoundError", "ShardError") and (absent[3] or absent[2]).endswith("/ar/2.ar"), absent


IMAGE_ONLY_PROBE = """
import json, sys
import datacat
if __name__ == "__main__":
    catalog = datacat.load_catalog([sys.argv[1]])
    for name in ("tars", "singles"):
        batches = list(datacat.open(name, framework=sys.argv[2], batch_size=4, catalog=catalog, num_workers=1))
        print("LOADED", json.dumps([name, sorted(k for b in batches for k in b["key"]), sorted(batches[0])]))
"""


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_image_only_sets_load_without_captions(framework: str, tmp_path: Path) -> None:
    from helpers import make_array_record, make_tar, sample_members

    (tmp_path / "tars").mkdir()
    members = [(n, data) for n, data in sample_members([f"{i:03d}" for i in range(6)]) if not n.endswith(".txt")]
    make_tar(tmp_path / "tars" / "0.tar", members)
    jpegs = [data for n, data in members if n.endswith(".jpg")]
    make_array_record(tmp_path / "singles.ar", jpegs)  # the `single` layout: one encoded image per record
    (tmp_path / "c.yaml").write_text(
        "tars: {description: d, format: webdataset, location: {root: tars, shards: 0.tar}, record: {caption: null}, "
        "loading: {val_batches: 0, image_size: 16}}\n"
        "singles: {description: d, format: array_record, location: {root: ., shards: singles.ar}, "
        "record: {layout: single}, loading: {val_batches: 0, image_size: 16}}\n"
    )
    loaded = _probe(tmp_path, IMAGE_ONLY_PROBE, framework, "LOADED ")
    assert len(loaded) == 2, loaded
    (_, tar_keys, tar_fields), (_, single_keys, single_fields) = loaded
    assert tar_keys == [f"{i:03d}" for i in range(6)] and len(single_keys) == 6
    assert "caption" not in tar_fields and "caption" not in single_fields and "image" in tar_fields, loaded
