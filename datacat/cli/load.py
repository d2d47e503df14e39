"""The load command: ``datacat load`` opens an entry's loader and reads batches from it.

torch, jax and the readers are imported when the command runs.
"""

from __future__ import annotations

import click

from datacat.cli._shared import catalog_of, err, out, reports_errors
from datacat.schema import BadSamplePolicy


@click.command()
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
@reports_errors
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
        catalog=catalog_of(ctx),
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
