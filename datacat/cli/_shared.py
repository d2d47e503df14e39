"""What the CLI's commands share: the consoles, catalog loading, error reporting and readers checks.

The CLI is the only part of datacat that prints or exits. Library errors arrive as
``DatacatError`` and leave as one clear line (or one line per catalog problem) and
exit status 1.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
from rich.console import Console

from datacat.catalog import Catalog, load_catalog
from datacat.errors import BackendUnavailable, CatalogError, DatacatError
from datacat.redact import redact

__all__ = [
    "catalog_of",
    "catalog_option",
    "err",
    "human_bytes",
    "human_count",
    "job_options",
    "out",
    "readers_installed",
    "reports_errors",
]

F = TypeVar("F", bound=Callable[..., Any])
# Piped output gets a wide table rather than rich's 80-column default.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def reports_errors(func: F) -> F:
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


def readers_installed(command: str) -> None:
    """Raises BackendUnavailable naming the extra when the shard readers' libraries are not installed."""
    try:
        import datacat.loading.sources  # noqa: F401 (numpy, Pillow, simplejpeg, OpenCV come with it)
    except ImportError as exc:
        raise BackendUnavailable(
            f"`datacat {command}` reads shards, which needs {exc.name or 'the readers'}: pip install 'datacat[images]' "
            "(or 'datacat[torch]' / 'datacat[jax]', which include it)"
        ) from None


def catalog_option(func: F) -> F:
    """Adds the repeatable ``--catalog PATH`` option, kept on the context for ``catalog_of``."""
    return click.option(
        "--catalog",
        "catalogs",
        multiple=True,
        type=click.Path(),
        metavar="PATH",
        help="A catalog file or folder that adds to or overrides the built-in one (repeatable; also $DATACAT_CATALOG).",
    )(func)


def catalog_of(ctx: click.Context) -> Catalog:
    """The catalog: the built-in one plus the ``--catalog`` paths given to the group."""
    return load_catalog(ctx.obj or (), named_by="--catalog")


def human_count(n: int | None, *, approx: bool = False) -> str:
    if n is None:
        return "?"
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{'~' if approx else ''}{n / size:.3g}{unit}"  # 500000 is 500k, 12345678 is 12.3M
    return str(n)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return str(n)


# The job options of `convert`, `embed` and `verify --deep`: Beam is imported when a job starts.
def job_options(runner: str | None, workers: int | None, flags: list[str]) -> Any:
    """Beam's PipelineOptions from the command's --runner and --workers and the flags after them."""
    readers_installed("a Beam job")
    try:
        from datacat.beam import pipeline_options
    except ImportError as exc:
        raise BackendUnavailable(f"Beam jobs need apache-beam: pip install 'datacat[beam]' ({exc.name})") from None
    args = [*flags, *([f"--runner={runner}"] if runner else [])]
    return pipeline_options(args, workers=workers or os.cpu_count() or 1)
