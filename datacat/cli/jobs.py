"""The Beam job commands: ``datacat convert``, ``datacat embed``, and the job options of ``verify --deep``.

Each takes Beam's own flags after its options (``--runner DataflowRunner
--project ... --region ... --temp_location gs://...``), passed through
unchanged; without ``--runner`` the job runs on Beam's DirectRunner in
``--workers`` processes on this machine. Beam is imported when a job
starts, never by ``datacat list`` or ``describe``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from datacat.cli._shared import catalog_of, err, job_options, out, reports_errors
from datacat.cli.joblog import job_log

__all__ = ["convert", "embed"]

_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True}


def _summary(title: str, counters: dict[str, int], catalog_file: str, names: list[str], log: Path | None) -> None:
    table = Table(title=title)
    table.add_column("counter")
    table.add_column("value", justify="right")
    for name in sorted(counters):
        table.add_row(name.replace("_", " "), f"{counters[name]:,}")
    out.print(table)
    out.print(f"catalog entry: {catalog_file}", markup=False)
    for name in names:
        out.print(f"load it: datacat --catalog {catalog_file} load {name}", markup=False)
    if log is not None:
        out.print(f"Beam's log: {log}", markup=False)


def _entries_of(catalog: Any, catalog_file: str) -> list[str]:
    """The entries a job wrote, in the order of its catalog file."""
    written = os.path.realpath(catalog_file)
    return [n for n, source in catalog.sources.items() if os.path.realpath(str(source.file)) == written]


def _runner_options(func: Any) -> Any:
    func = click.option("--runner", default=None, help="A Beam runner (default DirectRunner); its flags follow.")(func)
    func = click.option(
        "--verbose", is_flag=True, help="Show Beam's and its workers' log lines here instead of in a log file."
    )(func)
    return click.option(
        "--workers",
        default=None,
        type=click.IntRange(min=1),
        help="DirectRunner worker processes (default: one per core).",
    )(func)


@click.command(context_settings=_PASS_THROUGH)
@click.argument("name")
@click.option("--to", "to", type=click.Choice(["array_record"]), default="array_record", show_default=True)
@click.option("--out", required=True, help="Folder (local or gs://) for the shards and their catalog entry.")
@click.option("--layout", type=click.Choice(["packed", "pre_resized"]), default="packed", show_default=True)
@click.option("--records-per-shard", default=1000, show_default=True, type=click.IntRange(min=1))
@click.option("--entry-name", default="", help="Name of the new entry (default: NAME-converted).")
@_runner_options
@click.pass_context
@reports_errors
def convert(
    ctx: click.Context,
    name: str,
    to: str,
    out: str,
    layout: str,
    records_per_shard: int,
    entry_name: str,
    runner: str | None,
    workers: int | None,
    verbose: bool,
) -> None:
    """Convert NAME (any format, mixtures too) to ArrayRecord shards with their catalog entry, as a Beam job.

    Beam's pipeline flags may follow, e.g. --runner DataflowRunner --project P --region R --temp_location gs://B/tmp.
    """
    with job_log("convert", verbose=verbose) as log:
        options = job_options(runner, workers, list(ctx.args))
        from datacat.beam.convert import convert as run_convert

        err.print(f"converting {name} to {out} ({layout}, {records_per_shard} records per shard)...", markup=False)
        catalog_file, counters = run_convert(
            name,
            out,
            catalog=catalog_of(ctx),
            layout=layout,
            records_per_shard=records_per_shard,
            entry_name=entry_name,
            options=options,
        )
    from datacat.catalog import load_catalog
    from datacat.verify import verify

    written = load_catalog([catalog_file])
    names = _entries_of(written, catalog_file)
    for entry in names:  # the manifest `datacat verify` would write: later opens read no footer
        verify(entry, catalog=written)
    _summary(f"datacat convert {name}", counters, catalog_file, names, log)


@click.command(context_settings=_PASS_THROUGH)
@click.argument("name")
@click.option("--fn", "fn", required=True, help="module:function, fn(images uint8 [B,H,W,3], captions) -> dict.")
@click.option("--out", required=True, help="Folder (local or gs://) for the embedding files and their catalog entries.")
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(min=1))
@_runner_options
@click.pass_context
@reports_errors
def embed(
    ctx: click.Context,
    name: str,
    fn: str,
    out: str,
    batch_size: int,
    runner: str | None,
    workers: int | None,
    verbose: bool,
) -> None:
    """Apply FN to every record of NAME in batches and write DALLE2-style embedding files aligned with its shards."""
    with job_log("embed", verbose=verbose) as log:
        options = job_options(runner, workers, list(ctx.args))
        from datacat.beam.embed import embed as run_embed

        err.print(f"embedding {name} with {fn} into {out}...", markup=False)
        catalog_file, counters = run_embed(
            name, out, fn, catalog=catalog_of(ctx), batch_size=batch_size, options=options
        )

    from datacat.catalog import load_catalog

    names = _entries_of(load_catalog([catalog_file]), catalog_file)
    _summary(f"datacat embed {name}", counters, catalog_file, names, log)
