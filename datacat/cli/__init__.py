"""The ``datacat`` command group, and the registration of its command modules.

Imports run one way: each command module imports ``datacat.cli._shared`` and
nothing else of the CLI; this module gathers them onto ``main``.
"""

from __future__ import annotations

import click

from datacat.cli import cache, catalog_commands, jobs, load, verify
from datacat.cli._shared import catalog_option

__all__ = ["main"]


@click.group()
@click.version_option(package_name="datacat", prog_name="datacat")
@catalog_option
@click.pass_context
def main(ctx: click.Context, catalogs: tuple[str, ...]) -> None:
    """A catalog of sharded image-text datasets, and loaders for torch and jax."""
    ctx.obj = catalogs


for _command in (
    catalog_commands.list_command,
    catalog_commands.describe,
    load.load,
    catalog_commands.count,
    verify.verify,
    catalog_commands.validate,
    catalog_commands.schema,
    jobs.convert,
    jobs.embed,
    cache.cache,
):
    main.add_command(_command)
