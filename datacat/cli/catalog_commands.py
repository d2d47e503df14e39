"""The catalog commands: ``datacat list``, ``describe``, ``count``, ``validate`` and ``schema``.

``list`` and ``describe`` read YAML and resolve plans only: they import no
torch, jax, grain or numpy (a test checks ``sys.modules``).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import click
from rich.table import Table

from datacat.catalog import load_catalog
from datacat.cli._shared import catalog_of, human_bytes, human_count, out, readers_installed, reports_errors
from datacat.describe import describe as describe_entry
from datacat.errors import OptionError
from datacat.planning import resolve
from datacat.schema import Entry


def _loading_line(loading: dict[str, Any]) -> str:
    return (
        f"image_size {loading['image_size']}, augmentation {loading['augmentation']}, "
        f"resize {loading['resize']}, val_batches {loading['val_batches']}, val_split {loading['val_split']}, "
        f"count {loading['count']}, on_bad_sample {loading['on_bad_sample']} (budget {loading['bad_sample_budget']})"
    )


@click.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.pass_context
@reports_errors
def list_command(ctx: click.Context, as_json: bool) -> None:
    """List every catalog entry with its format, shards, samples, size and location."""
    catalog = catalog_of(ctx)
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
            human_count(row["samples"], approx=not row["samples_exact"]),
            human_bytes(row["bytes"]),
            row["location"],
        )
    out.print(table)


@click.command()
@click.argument("name")
@click.option("--split", default="train", show_default=True, help="The split to resolve.")
@click.option("--root", default=None, help="Replace the entry's root (default $DATACAT_ROOT or the catalog's).")
@click.option("--all-shards", is_flag=True, help="List every shard URL, not the first and last few.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@click.pass_context
@reports_errors
def describe(ctx: click.Context, name: str, split: str, root: str | None, all_shards: bool, as_json: bool) -> None:
    """Describe one entry: its Plan, its declared facts and the layout its files must follow."""
    info = describe_entry(name, catalog=catalog_of(ctx), split=split, root=root)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    _print_description(info, all_shards=all_shards)


_OPERATORS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "eq": "==", "ne": "!=", "in_": "in"}


def _bounds(ops: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(_OPERATORS.get(op, op), value) for op, value in ops.items() if value is not None]


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
                f"{indent}    {comp['weight']:.4f}  {p['name']}  ({p['format']}, {count}, samples {human_count(p['samples'], approx=not p['samples_exact'])})"
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
    if plan.get("select"):
        bounds = ", ".join(
            f"{column} {op} {value}" for column, ops in plan["select"].items() for op, value in _bounds(ops)
        )
        selected = info.get("selected")
        count = "counted when a loader first opens it" if selected is None else f"{selected:,} records"
        say(f"{indent}  select: {bounds}: {count}")
    say(f"{indent}  size: {human_bytes(plan['bytes'])}")
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


@click.command()
@click.argument("name")
@click.option("--root", default=None, help="Replace the entry's root.")
@click.option("--threads", default=8, show_default=True, type=click.IntRange(min=1), help="Shards read at once.")
@click.pass_context
@reports_errors
def count(ctx: click.Context, name: str, root: str | None, threads: int) -> None:
    """Count the records of every shard of NAME and print the totals lines for its catalog entry."""
    import concurrent.futures

    readers_installed("count")
    from datacat.formats import count_shard, open_reader
    from datacat.registry import MIXTURE, format_of

    plan = resolve(name, catalog=catalog_of(ctx), root=root, val_batches=0, count=None)
    if plan.format == MIXTURE or format_of(plan.format).counted != "per_shard":
        raise OptionError(f"{plan.name} is {plan.format}: its records are counted when it is opened, not per shard")
    reader = open_reader(plan)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        counts = list(pool.map(lambda shard: count_shard(reader, shard), range(len(plan.shards))))
    shards = ", ".join(f"{s.name}: {n}" for s, n in zip(plan.shards, counts, strict=True))
    click.echo(f"# {plan.name}: records per shard, counted from {len(counts)} shard(s); paste under the entry")
    click.echo(f"totals:\n  shards: {len(counts)}\n  samples: {sum(counts)}\n  per_shard: {{{shards}}}")


@click.command()
@click.argument("paths", nargs=-1, type=click.Path())
@click.pass_context
@reports_errors
def validate(ctx: click.Context, paths: tuple[str, ...]) -> None:
    """Validate catalog files (default: the built-in catalog and $DATACAT_CATALOG); exit 1 listing every problem."""
    catalog = load_catalog((*(ctx.obj or ()), *paths), named_by="--catalog or the paths given")
    out.print(f"{len(catalog)} entries valid.", markup=False)


@click.command()
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
