"""Jobs past one machine, as Apache Beam pipelines: ``convert``, ``embed`` and ``verify --deep``.

The same pipeline runs on Beam's DirectRunner (several processes on one
machine) and, unchanged, on Dataflow, Flink or Spark: the runner and its
options are Beam's own command-line flags (``--runner DataflowRunner
--project ... --region ... --temp_location gs://...``), passed through.

Every job is split into units of work named by number (an output shard,
an input shard) so that a unit's output depends on nothing but its number:
a retried or duplicated bundle writes the same bytes again, under a
temporary name first, committed by a rename (local) or a single upload (a
bucket). Readers and user functions are built once per worker, in
``DoFn.setup``, from a picklable :class:`~datacat.resolve.Plan`.

Needs the ``beam`` extra: ``pip install 'datacat[beam]'``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from datacat import errors
from datacat.errors import BackendUnavailable, DatacatError
from datacat.redact import redact
from datacat.storage import filesystem, is_remote

# Beam's import warns through logging.warning(), which configures the root logger for the whole process
# when nothing has (every later INFO line of any library would print). A handler held only during the
# import keeps that from happening, and leaves the process's logging as the user set it up.
_root, _quiet = logging.getLogger(), logging.NullHandler()
_root.addHandler(_quiet)
try:
    import apache_beam as beam
    from apache_beam.metrics.metric import MetricsFilter
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions, StandardOptions, WorkerOptions
except ImportError as exc:  # pragma: no cover - the extra is installed in every test run
    raise BackendUnavailable(
        f"Beam jobs need Apache Beam: pip install 'datacat[beam]' ({exc.name} is not installed)"
    ) from exc
finally:
    _root.removeHandler(_quiet)

__all__ = [
    "DASK_RUNNER",
    "NAMESPACE",
    "clear_scratch",
    "commit",
    "counter",
    "local_catalog",
    "part_of",
    "pipeline_options",
    "run",
    "scratch",
    "text_file",
    "whole_epoch",
]

DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
"""The full name of Beam's DaskRunner, which ``--runner DaskRunner`` stands for."""

NAMESPACE = "datacat"
"""The namespace of every counter a job keeps (records read, written, bad)."""


def pipeline_options(args: Sequence[str] = (), *, workers: int | None = None) -> PipelineOptions:
    """Beam's options from its command-line flags; the DirectRunner by default, on ``workers`` processes.

    ``workers`` > 1 on the DirectRunner runs bundles in that many worker
    processes (``direct_running_mode=multi_processing``); other runners
    size themselves from their own flags.
    """
    options = PipelineOptions(list(args))
    if not any(a.startswith("--default_sdk_harness_log_level") for a in args):
        options.view_as(WorkerOptions).default_sdk_harness_log_level = "WARNING"  # workers: problems only
    standard = options.view_as(StandardOptions)
    if standard.runner is None:
        standard.runner = "DirectRunner"
    if standard.runner in ("DaskRunner", "dask"):  # Beam knows it only by its full name
        standard.runner = DASK_RUNNER
    if standard.runner == DASK_RUNNER and not any(
        a.startswith(("--dask_npartitions", "--dask_partition_size")) for a in args
    ):
        # One unit of work per dask partition, so that the units spread over the workers (Beam's default
        # packs 128 into one). Imported here: it imports dask.distributed, which only this runner needs.
        from apache_beam.runners.dask.dask_runner import DaskOptions

        options.view_as(DaskOptions).partition_size = 1
    if workers is not None and standard.runner in ("DirectRunner", "direct"):
        direct = options.view_as(DirectOptions)
        direct.direct_num_workers = workers
        direct.direct_running_mode = "multi_processing" if workers > 1 else "in_memory"
    return options


def counter(name: str) -> Any:
    """A Beam counter in the datacat namespace (a DoFn increments it; ``run`` reports it)."""
    return beam.metrics.Metrics.counter(NAMESPACE, name)


def run(pipeline: beam.Pipeline, *, counted: Callable[[], dict[str, int]] | None = None) -> dict[str, int]:
    """Runs ``pipeline`` to the end and returns its datacat counters, by name.

    A runner that keeps no metrics (the DaskRunner) gets them from
    ``counted``, which reads them back from what the job wrote. A job that
    fails raises datacat's own error when one caused it (a shard that cannot
    be read is the same ShardError as in a loader; a user function's error
    is a FunctionError naming the function and the record); otherwise a
    DatacatError with the last line of what the runner reported, secrets
    redacted. Beam wraps a worker's error in its own exceptions.
    """
    result = None
    try:
        result = pipeline.run()
        result.wait_until_finish()
    except Exception as exc:  # sorted below: datacat's errors come out as they are
        _raise_cause(exc)
    finally:
        client = getattr(result, "client", None)  # the DaskRunner's connection to the scheduler, left open by Beam
        if client is not None:
            client.close()
    try:
        found = result.metrics().query(MetricsFilter().with_namespace(NAMESPACE))["counters"]
    except NotImplementedError:  # the DaskRunner: "collecting metrics will come later"
        return counted() if counted is not None else {}
    totals: dict[str, int] = {}
    for metric in found:
        value = metric.committed if metric.committed is not None else metric.attempted
        totals[metric.key.metric.name] = totals.get(metric.key.metric.name, 0) + int(value or 0)
    return totals


def _raise_cause(exc: Exception) -> NoReturn:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, DatacatError | FileNotFoundError):
            raise cause.with_traceback(None) from None
        cause = cause.__cause__ or cause.__context__
    lines = [line.strip() for line in redact(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    # A worker process's error arrives as text, its last line "RuntimeError: ShardError: ... [while
    # running 'write']": the first class named there that datacat raises is raised again.
    text = re.sub(r" \[while running '[^']*'\]$", "", last)
    while ": " in text:
        kind, _, message = text.partition(": ")
        known = getattr(errors, kind, None)
        if isinstance(known, type) and issubclass(known, DatacatError) and known is not errors.CatalogError:
            raise known(message) from None
        if kind == "FileNotFoundError":
            raise FileNotFoundError(2, re.sub(r"^\[Errno 2\] ", "", message)) from None
        text = message
    raise DatacatError(f"the Beam job failed: {last}") from None


def scratch(out: str) -> str:
    """Where unfinished files of a job writing to ``out`` go: a hidden folder no entry names."""
    return out.rstrip("/") + "/.datacat-tmp"


def commit(url: str, write: Callable[[str], None], storage_options: dict[str, Any] | None = None) -> None:
    """Writes a file whole under ``url``, or not at all: ``write(path)`` fills a local file first.

    Local: written beside the target in the scratch folder, then renamed
    over it. A bucket: uploaded in one request (an object appears only
    whole). Two attempts at the same unit write the same bytes, so either
    may win.
    """
    name = url.rsplit("/", 1)[-1]
    if not is_remote(url):
        path = url.removeprefix("file://")
        tmp_dir = scratch(os.path.dirname(path) or ".")
        os.makedirs(tmp_dir, exist_ok=True)
        tmp = os.path.join(tmp_dir, f"{name}.{uuid.uuid4().hex}")
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return
    fs, path = filesystem(url, storage_options)
    with tempfile.TemporaryDirectory(prefix="datacat-") as local:
        tmp = os.path.join(local, name)
        write(tmp)
        fs.put_file(tmp, path)


def clear_scratch(out: str) -> None:
    """Removes the scratch folder of a finished job writing to a local ``out`` (what a killed attempt left).

    A bucket has none: each file there is one upload.
    """
    if not is_remote(out):
        shutil.rmtree(scratch(out.removeprefix("file://")), ignore_errors=True)


def local_catalog(url: str, storage_options: dict[str, Any] | None = None) -> str:
    """A local path of the catalog file a job wrote at ``url``: itself, or a copy from the bucket.

    The copy goes to ``$DATACAT_CACHE/catalogs/`` (its roots are the bucket's
    URLs, so it loads from anywhere), for ``datacat --catalog PATH load``.
    """
    if not is_remote(url):
        return url.removeprefix("file://")
    from datacat.cache import cache_dir
    from datacat.storage import read_bytes

    text = read_bytes(url, storage_options)
    folder = cache_dir() / "catalogs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}.yaml"
    path.write_bytes(text)
    return str(path)


def part_of(plan: Any, first: int, stop: int, counts: Sequence[int]) -> Any:
    """``plan`` narrowed to its shards ``[first, stop)``, each with its record count.

    A unit of work opens only the shards it reads: a worker never indexes
    (reads whole) a tar shard another worker's unit covers.
    """
    shards = tuple(s.model_copy(update={"samples": counts[i]}) for i, s in enumerate(plan.shards[first:stop], first))
    return plan.model_copy(update={"shards": shards, "samples": sum(counts[first:stop])})


def text_file(text: str) -> Callable[[str], None]:
    """A ``write(path)`` for :func:`commit` that writes ``text`` (utf-8)."""

    def write(path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    return write


def whole_epoch(plan: Any) -> Any:
    """``plan``'s source and one view of its whole epoch 0 on one rank, unshuffled: canonical positions in order."""
    from datacat.loading.epochs import Schedule
    from datacat.loading.mixture import open_source

    source = open_source(plan)
    total = source.epoch_length(plan.seed, 0)
    return source, source.view(Schedule(total, 0, total, (total,)), seed=plan.seed, epoch=0, shuffle=False)
