"""The ``datacat`` command: list, describe, validate and schema.

The only module that prints or exits. Library errors arrive as
``DatacatError`` and leave as one clear line (or one line per catalog
problem) and exit status 1.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from datacat.catalog import Catalog, load_catalog
from datacat.describe import describe as describe_entry
from datacat.errors import BackendUnavailable, CatalogError, DatacatError, OptionError
from datacat.planning import resolve
from datacat.redact import redact
from datacat.schema import BadSamplePolicy, Entry

F = TypeVar("F", bound=Callable[..., Any])
# Piped output gets a wide table rather than rich's 80-column default.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _reports_errors(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except CatalogError as exc:
            for problem in exc.problems:
                err.print(str(problem), markup=False)
            err.print(f"{len(exc.problems)} problem(s).", markup=False)
            sys.exit(1)
        except (DatacatError, FileNotFoundError) as exc:
            err.print(f"error: {redact(exc)}", markup=False)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def _loading_line(loading: dict[str, Any]) -> str:
    return (
        f"image_size {loading['image_size']}, augmentation {loading['augmentation']}, "
        f"resize {loading['resize']}, val_batches {loading['val_batches']}, val_split {loading['val_split']}, "
        f"count {loading['count']}, on_bad_sample {loading['on_bad_sample']} (budget {loading['bad_sample_budget']})"
    )


def _readers_installed(command: str) -> None:
    """Raises BackendUnavailable naming the extra when the shard readers' libraries are not installed."""
    try:
        import datacat.pipeline  # noqa: F401 (numpy, Pillow, simplejpeg, OpenCV come with it)
    except ImportError as exc:
        raise BackendUnavailable(
            f"`datacat {command}` reads shards, which needs {exc.name or 'the readers'}: pip install 'datacat[images]' "
            "(or 'datacat[torch]' / 'datacat[jax]', which include it)"
        ) from None


@click.group()
@click.version_option(package_name="datacat", prog_name="datacat")
@click.option(
    "--catalog",
    "catalogs",
    multiple=True,
    type=click.Path(),
    metavar="PATH",
    help="A catalog file or folder that adds to or overrides the built-in one (repeatable; also $DATACAT_CATALOG).",
)
@click.pass_context
def main(ctx: click.Context, catalogs: tuple[str, ...]) -> None:
    """A catalog of sharded image-text datasets, and loaders for torch and jax."""
    ctx.obj = catalogs


def _catalog(ctx: click.Context) -> Catalog:
    return load_catalog(ctx.obj or (), named_by="--catalog")


def _human(n: int | None, *, approx: bool = False) -> str:
    if n is None:
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{'~' if approx else ''}{n / size:.3g}{unit}"  # 500000 is 500k, 12345678 is 12.3M
    return str(n)


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
@_reports_errors
def list_command(ctx: click.Context, as_json: bool) -> None:
    """List every catalog entry with its format, shards, samples, size and location."""
    catalog = _catalog(ctx)
    rows: list[dict[str, Any]] = []
    for name in catalog:
        plan = resolve(name, catalog=catalog, list_shards=False)
        entry = catalog[name]
        rows.append(
            {
                "name": name,
                "format": plan.format,
                "shards": None if plan.glob or plan.components else len(plan.shards),
                "missing": len(plan.missing),
                "components": [c.plan.name for c in plan.components],
                "samples": plan.samples,
                "samples_exact": plan.samples_exact,
                "bytes": plan.bytes,
                "location": plan.glob or (plan.root if not plan.components else ""),
                "description": entry.description,
                "source": catalog.sources[name].file,
            }
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = Table(show_edge=False, pad_edge=False)
    for col, justify in (
        ("name", "left"),
        ("format", "left"),
        ("shards", "right"),
        ("samples", "right"),
        ("size", "right"),
        ("location", "left"),
    ):
        # The name is what a user types: never cut or wrapped, whatever the terminal's width.
        table.add_column(
            col,
            justify=justify,  # type: ignore[arg-type]
            no_wrap=col == "name",
            min_width=max(len(r["name"]) for r in rows) if col == "name" else None,
        )
    for row in rows:
        if row["components"]:
            shards = f"{len(row['components'])} parts"
        elif row["shards"] is None:
            shards = "listed"
        else:
            shards = f"{row['shards']}" + (f" ({row['missing']} missing)" if row["missing"] else "")
        table.add_row(
            row["name"],
            row["format"],
            shards,
            _human(row["samples"], approx=not row["samples_exact"]),
            _bytes(row["bytes"]),
            row["location"],
        )
    out.print(table)


@main.command()
@click.argument("name")
@click.option("--split", default="train", show_default=True, help="The split to resolve.")
@click.option("--root", default=None, help="Replace the entry's root (default $DATACAT_ROOT or the catalog's).")
@click.option("--all-shards", is_flag=True, help="List every shard URL, not the first and last few.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
@_reports_errors
def describe(ctx: click.Context, name: str, split: str, root: str | None, all_shards: bool, as_json: bool) -> None:
    """Describe one entry: its Plan, its declared facts and the layout its files must follow."""
    info = describe_entry(name, catalog=_catalog(ctx), split=split, root=root)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    _print_description(info, all_shards=all_shards)


def _print_description(info: dict[str, Any], *, all_shards: bool, indent: str = "") -> None:
    plan = info["plan"]
    say = functools.partial(out.print, markup=False)
    aliases = f"  (aliases: {', '.join(info['aliases'])})" if info["aliases"] else ""
    say(f"{indent}{info['name']}{aliases}")
    say(f"{indent}  {info['description']}")
    say(f"{indent}  defined in: {info['source']}:{info['line']}")
    for old in info["overrides"]:
        say(f"{indent}  overrides:  the entry in {old}")
    for key in ("homepage", "license", "citation"):
        if info[key]:
            say(f"{indent}  {key}: {info[key]}")
    layout = f", layout {plan['record']['layout']}" if plan["record"]["layout"] else ""
    say(f"{indent}  format: {plan['format']} ({plan['access']} access){layout}")
    if plan["components"]:
        say(f"{indent}  mixture of {len(plan['components'])}, exhaustion {plan['exhaustion']}:")
        for comp in plan["components"]:
            p = comp["plan"]
            count = f"{len(p['shards'])} shards" if p["glob"] is None else f"shards listed at load ({p['glob']})"
            say(
                f"{indent}    {comp['weight']:.4f}  {p['name']}  ({p['format']}, {count}, samples {_human(p['samples'], approx=not p['samples_exact'])})"
            )
    else:
        say(f"{indent}  location: {plan['root']}")
        say(f"{indent}  shards: {info['pattern']}")
        if plan["glob"] is not None:
            say(f"{indent}    listed when opened: {plan['glob']}")
        else:
            missing = ", ".join(m.rsplit("/", 1)[-1] for m in plan["missing"]) or "none"
            total = len(plan["shards"]) + len(plan["missing"])
            say(f"{indent}    {len(plan['shards'])} resolved URLs of {total} named; missing: {missing}")
            urls = [s["url"] for s in plan["shards"]]
            shown = (
                urls
                if all_shards or len(urls) <= 12
                else [*urls[:3], f"... {len(urls) - 6} more (--all-shards) ...", *urls[-3:]]
            )
            for url in shown:
                say(f"{indent}    {url}")
        if plan["missing"]:
            say(f"{indent}  missing shards (excluded): {', '.join(plan['missing'])}")
    samples = plan["samples"]
    exactness = "declared per shard" if plan["samples_exact"] else "declared, approximate"
    if plan.get("samples_counted"):
        exactness = "counted when first read, from the manifest cache"
    say(
        f"{indent}  samples: {'?' if samples is None else f'{samples:,}'}"
        + (
            " (no per_shard declared: counted when a loader opens; `datacat verify` counts once for all)"
            if samples is None
            else f" ({exactness})"
        )
    )
    say(f"{indent}  size: {_bytes(plan['bytes'])}")
    for split_name, split in (info.get("splits") or {}).items():
        count = "?" if split["samples"] is None else f"{split['samples']:,}"
        say(f"{indent}  split {split_name}: {split['pattern']}, samples {count} (--split {split_name} reads it)")
    loading = plan["loading"]
    if plan["components"]:
        # A mixture's batches get each component's own loading, with what the mixture entry sets on top.
        say(f"{indent}  loading, as each component's batches get it:")
        for comp in plan["components"]:
            say(f"{indent}    {comp['plan']['name']}: {_loading_line(comp['plan']['loading'])}")
        loading = plan["components"][0]["plan"]["loading"]
    else:
        say(f"{indent}  loading: {_loading_line(loading)}")
    if loading["val_batches"] and not loading["val_split"]:
        batch = plan.get("batch_size") or 16
        say(
            f"{indent}  holdout: the first val_batches {loading['val_batches']} x batch size records are the validation "
            f"split, never trained on ({loading['val_batches'] * batch:,} at batch size {batch}; --split validation reads them)"
        )
    if plan["storage_options_shown"]:
        say(f"{indent}  storage_options: {json.dumps(plan['storage_options_shown'])}")
    say(f"{indent}  seed {plan['seed']}, split {plan['split']}, plan fingerprint {info['fingerprint']}")
    if info["notes"]:
        say(f"{indent}  notes: {info['notes']}")
    say(f"{indent}  layout contract:")
    for line in info["contract"]:
        say(f"{indent}    - {line}")


@main.command()
@click.argument("name")
@click.option("--framework", type=click.Choice(["torch", "jax", "auto"]), default="auto", show_default=True)
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--batches",
    default=None,
    type=click.IntRange(min=1),
    help="Stop after this many batches, across epochs (default: one epoch).",
)
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=0), help="Worker processes.")
@click.option("--image-size", default=None, type=click.IntRange(min=1), help="Override the entry's image size.")
@click.option("--seed", default=0, show_default=True)
@click.option("--split", default="train", show_default=True)
@click.option("--root", default=None, help="Replace the entry's root.")
@click.option(
    "--on-bad-sample", type=click.Choice(["raise", "skip"]), default=None, help="Override the entry's policy."
)
@click.option(
    "--grid", type=click.Path(dir_okay=False), default=None, help="Write a contact sheet of the first batch (PNG)."
)
@click.pass_context
@_reports_errors
def load(
    ctx: click.Context,
    name: str,
    framework: str,
    batch_size: int,
    batches: int | None,
    workers: int,
    image_size: int | None,
    seed: int,
    split: str,
    root: str | None,
    on_bad_sample: BadSamplePolicy | None,
    grid: str | None,
) -> None:
    """Load batches of NAME and report shapes, images per second and bad samples."""
    import logging
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from datacat.backends import open_loader

    # Storage clients log each retry with a traceback; the one error that matters is printed below.
    for noisy in ("gcsfs", "fsspec", "absl"):
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    loader = open_loader(
        name,
        framework=framework,
        batch_size=batch_size,
        split=split,
        seed=seed,
        root=root,
        catalog=_catalog(ctx),
        num_workers=workers,
        epochs=None if batches else 1,  # --batches may run past the end of an epoch
        image_size=image_size,
        on_bad_sample=on_bad_sample,
    )
    total = batches or len(loader)
    out.print(f"{loader!r}", markup=False)
    if loader.plan.holdout_records:
        out.print(
            f"holdout: {loader.plan.holdout_records:,} records (val_batches {loader.plan.loading.val_batches} x batch "
            f"{batch_size}) are the validation split, not trained on; {loader.schedule.records:,} train records an epoch",
            markup=False,
        )
    images, first, elapsed, first_after = 0, None, 0.0, 0.0
    opened = started = time.perf_counter()
    batches_iter = iter(loader)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[rate]}"),
        console=err,
        transient=False,
    ) as progress:
        task = progress.add_task(f"{loader.framework} {loader.plan.name}", total=total, rate="")
        try:
            for i, batch in enumerate(batches_iter):
                if first is None:
                    first = batch
                    started = time.perf_counter()  # the first batch pays for start-up; time the rest
                    first_after = started - opened
                else:
                    images += len(batch["key"])
                elapsed = time.perf_counter() - started
                progress.update(task, advance=1, rate=f"{images / elapsed:.0f} img/s" if images and elapsed > 0 else "")
                if i + 1 >= total:
                    break
        finally:
            batches_iter.close()
            loader.close()  # stops the worker processes now, not at exit
    assert first is not None  # len(loader) >= 1 is guaranteed by its schedule
    for key, value in first.items():
        if hasattr(value, "shape"):
            out.print(
                f"  {key}: {type(value).__module__.split('.')[0]} {tuple(value.shape)} {value.dtype}", markup=False
            )
        else:
            out.print(
                f"  {key}: list[{type(value[0]).__name__ if value else ''}] of {len(value)}, e.g. {value[0]!r}"
                if value
                else f"  {key}: []",
                markup=False,
            )
    # The first batch may come from this process while spawned workers boot, and the next ones wait for
    # them: in a short run that start-up is most of the time, so say both.
    rate = f"first batch after {first_after:.2f} s; all in {first_after + elapsed:.1f} s" + (
        f", {images / elapsed:.1f} images/s after the first (worker start-up included)"
        if images and elapsed > 0
        else ""
    )
    out.print(
        f"{loader.framework}, {loader.num_workers} worker(s), batch {loader.batch_size}, image {loader.plan.loading.image_size} px",
        markup=False,
    )
    out.print(f"{total} batch(es); {rate}", markup=False)
    out.print(loader.ledger.summary(), markup=False)
    for bad in loader.ledger.skipped[:20]:
        out.print(f"  skipped: {bad}", markup=False)
    if grid and "image" not in first:
        out.print(f"no contact sheet: {loader.plan.name}'s batches have no images", markup=False)
    elif grid:
        import numpy as np  # the image extras are installed if a batch was loaded

        from datacat.grid import contact_sheet

        path = contact_sheet(np.asarray(first["image"]), first.get("caption") or [""] * len(first["key"]), grid)
        out.print(f"contact sheet of the first batch: {path}", markup=False)


@main.command()
@click.argument("name")
@click.option("--root", default=None, help="Replace the entry's root.")
@click.option("--threads", default=8, show_default=True, type=click.IntRange(min=1), help="Shards read at once.")
@click.pass_context
@_reports_errors
def count(ctx: click.Context, name: str, root: str | None, threads: int) -> None:
    """Count the records of every shard of NAME and print the totals lines for its catalog entry."""
    import concurrent.futures

    _readers_installed("count")
    from datacat.formats import count_shard, open_reader
    from datacat.registry import format_of

    plan = resolve(name, catalog=_catalog(ctx), root=root, val_batches=0, count=None)
    if format_of(plan.format).counted != "per_shard":
        raise OptionError(f"{plan.name} is {plan.format}: its records are counted when it is opened, not per shard")
    reader = open_reader(plan)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        counts = list(pool.map(lambda shard: count_shard(reader, shard), range(len(plan.shards))))
    shards = ", ".join(f"{s.name}: {n}" for s, n in zip(plan.shards, counts, strict=True))
    click.echo(f"# {plan.name}: records per shard, counted from {len(counts)} shard(s); paste under the entry")
    click.echo(f"totals:\n  shards: {len(counts)}\n  samples: {sum(counts)}\n  per_shard: {{{shards}}}")


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("name")
@click.option("--deep", is_flag=True, help="Also read and decode every record; report each bad one with shard and key.")
@click.option(
    "--runner",
    default=None,
    help="Run the deep check as a Beam job on this runner (DirectRunner, DataflowRunner, ...); Beam's flags follow.",
)
@click.option("--workers", default=None, type=click.IntRange(min=1), help="DirectRunner processes (default: per core).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--root", default=None, help="Replace the entry's root.")
@click.option("--threads", default=16, show_default=True, type=click.IntRange(min=1), help="Shards read at once.")
@click.pass_context
@_reports_errors
def verify(
    ctx: click.Context,
    name: str,
    deep: bool,
    runner: str | None,
    workers: int | None,
    as_json: bool,
    root: str | None,
    threads: int,
) -> None:
    """Check NAME's shards against storage (absent, unexpected, counts, bytes) and write its manifest; exit 1 on any mismatch.

    With --deep --runner R, every record is read and decoded by a Beam job on R (Beam's flags may follow).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    _readers_installed("verify")
    from datacat.verify import verify as verify_entry

    if (runner or workers or ctx.args) and not deep:
        raise OptionError("--runner, --workers and Beam's flags go with --deep: only the deep check is a Beam job")
    deep_check = None
    if runner or workers or ctx.args:
        from datacat.cli_jobs import job_options

        options = job_options(runner, workers, list(ctx.args))
        from datacat.beam.verify import bad_records_job

        deep_check = functools.partial(bad_records_job, options=options)

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err
    ) as progress:
        tasks: dict[str, Any] = {}

        def advance(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(f"{stage} {name}", total=total)
            progress.update(tasks[stage], completed=done, total=total)

        report = verify_entry(
            name,
            catalog=_catalog(ctx),
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
            f"{report.entry}: {len(report.shards)} shard(s) found under {report.base}, {total:,} records, {_bytes(size)}",
            markup=False,
        )
        for problem in report.problems:
            out.print(f"  {problem}", markup=False)
        if report.manifest:
            out.print(f"manifest: {report.manifest}", markup=False)
        out.print(
            "ok: the shards match the entry." if report.ok else f"{len(report.problems)} problem(s).", markup=False
        )
    if not report.ok:
        sys.exit(1)


@main.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.pass_context
@_reports_errors
def validate(ctx: click.Context, paths: tuple[str, ...]) -> None:
    """Validate catalog files (default: the built-in catalog and $DATACAT_CATALOG); exit 1 listing every problem."""
    catalog = load_catalog((*(ctx.obj or ()), *paths), named_by="--catalog or the paths given")
    out.print(f"{len(catalog)} entries valid.", markup=False)


@main.command()
def schema() -> None:
    """Print the JSON Schema of a catalog file, for editor completion of YAML."""
    body = Entry.model_json_schema()
    defs = body.pop("$defs", {})
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "datacat catalog file",
        "description": "A mapping of entry name to entry.",
        "type": "object",
        "additionalProperties": {"$ref": "#/$defs/Entry"},
        "$defs": {**defs, "Entry": body},
    }
    click.echo(json.dumps(doc, indent=2))


# The Beam jobs' commands (convert, embed) register themselves on `main`; Beam is imported when one runs.
from datacat import cli_jobs  # noqa: E402, F401
