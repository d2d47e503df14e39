"""``datacat cache``: what the node-local shard cache holds, and emptying it."""

from __future__ import annotations

import click

from datacat.cli._shared import human_bytes, reports_errors
from datacat.storage.shard_cache import ShardCache

__all__ = ["cache"]

_FOLDER = click.option(
    "--dir",
    "folder",
    default=None,
    help="The cache folder (default: $DATACAT_SHARD_CACHE, else shards/ in datacat's cache folder).",
)


def _cache(folder: str | None) -> ShardCache:
    return ShardCache(folder or ShardCache.default_folder(), 1)  # the cap is the fillers', recorded in the folder


@click.group()
def cache() -> None:
    """The node-local shard cache of remote shards (see docs/remote.md)."""


@cache.command()
@_FOLDER
@reports_errors
def info(folder: str | None) -> None:
    """Print the cache folder, its shards and bytes, downloads under way, and its cap."""
    usage = _cache(folder).usage()
    cap = human_bytes(usage.max_bytes) if usage.max_bytes is not None else "none recorded (never filled)"
    click.echo(f"folder:   {usage.folder}")
    click.echo(f"shards:   {usage.shards} ({human_bytes(usage.shard_bytes)}, {usage.shard_bytes} bytes)")
    click.echo(f"partial:  {usage.partial} ({human_bytes(usage.partial_bytes)})")
    click.echo(f"cap:      {cap}")


@cache.command()
@_FOLDER
@reports_errors
def clear(folder: str | None) -> None:
    """Delete every cached shard (downloads a running loader holds are left to it)."""
    files, freed = _cache(folder).clear()
    click.echo(f"deleted {files} file(s), {human_bytes(freed)}")
