"""The verify command: ``datacat verify`` checks an entry's shards, and with ``--deep`` every record.

``--deep`` with ``--runner``/``--workers`` and Beam's flags runs the check as a
Beam job (its options come from ``datacat.cli._shared.job_options``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from typing import Any

import click

from datacat.cli._shared import catalog_of, err, human_bytes, job_options, out, readers_installed, reports_errors
from datacat.cli.joblog import job_log
from datacat.errors import OptionError


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("name")
@click.option("--deep", is_flag=True, help="Also read and decode every record; report each bad one with shard and key.")
@click.option(
    "--runner",
    default=None,
    help="Run the deep check as a Beam job on this runner (DirectRunner, DataflowRunner, ...); Beam's flags follow.",
)
@click.option("--workers", default=None, type=click.IntRange(min=1), help="DirectRunner processes (default: per core).")
@click.option("--verbose", is_flag=True, help="With --runner: Beam's log lines here instead of in a log file.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--root", default=None, help="Replace the entry's root.")
@click.option("--threads", default=16, show_default=True, type=click.IntRange(min=1), help="Shards read at once.")
@click.pass_context
@reports_errors
def verify(
    ctx: click.Context,
    name: str,
    deep: bool,
    runner: str | None,
    workers: int | None,
    verbose: bool,
    as_json: bool,
    root: str | None,
    threads: int,
) -> None:
    """Check NAME's shards against storage (absent, unexpected, counts, bytes) and write its manifest; exit 1 on any mismatch.

    With --deep --runner R, every record is read and decoded by a Beam job on R (Beam's flags may follow).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    readers_installed("verify")
    from datacat.verify import verify as verify_entry

    if (runner or workers or ctx.args) and not deep:
        raise OptionError("--runner, --workers and Beam's flags go with --deep: only the deep check is a Beam job")
    deep_check = None
    on_beam = bool(runner or workers or ctx.args)
    logged = job_log("verify", verbose=verbose) if on_beam else contextlib.nullcontext()
    with (
        logged as log,
        Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
        ) as progress,
    ):
        if on_beam:
            options = job_options(runner, workers, list(ctx.args))
            from datacat.beam.verify import bad_records_job

            deep_check = functools.partial(bad_records_job, options=options)
        tasks: dict[str, Any] = {}

        def advance(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(f"{stage} {name}", total=total)
            progress.update(tasks[stage], completed=done, total=total)

        report = verify_entry(
            name,
            catalog=catalog_of(ctx),
            root=root,
            deep=deep,
            threads=threads,
            progress=advance,
            deep_check=deep_check,
        )
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        records = [s.records for s in report.shards]
        total = sum(r or 0 for r in records)
        size = sum(s.bytes or 0 for s in report.shards)
        out.print(
            f"{report.entry}: {len(report.shards)} shard(s) found under {report.base}, {total:,} records, {human_bytes(size)}",
            markup=False,
        )
        for problem in report.problems:
            out.print(f"  {problem}", markup=False)
        if report.selected is not None:
            out.print(f"select keeps {report.selected:,} of {total:,} records (cached for every loader)", markup=False)
        if report.manifest:
            out.print(f"manifest: {report.manifest}", markup=False)
        out.print(
            "ok: the shards match the entry." if report.ok else f"{len(report.problems)} problem(s).", markup=False
        )
    if log is not None:
        (err if as_json else out).print(f"Beam's log: {log}", markup=False)  # stdout stays JSON with --json
    if not report.ok:
        sys.exit(1)
