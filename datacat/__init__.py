"""datacat: a declarative catalog of sharded image-text datasets, and their loaders.

A YAML entry says where a dataset's shards live and how a record is laid out;
``resolve`` turns an entry into a framework-free Plan, and the torch and jax
backends run that Plan. Importing datacat imports neither framework.
"""

from datacat.backends import open_loader as open
from datacat.catalog import Catalog, load_catalog
from datacat.describe import describe
from datacat.errors import (
    BackendUnavailable,
    CatalogError,
    DatacatError,
    EntryNotFound,
    OptionError,
    ShardError,
)
from datacat.loading.contracts import Loader
from datacat.loading.options import JaxOptions, LoadOptions, TorchOptions
from datacat.plan import Plan
from datacat.planning import resolve
from datacat.registry import Format, register_format
from datacat.schema import Entry, Section
from datacat.storage.shard_cache import ShardCache

__all__ = [
    "BackendUnavailable",
    "Catalog",
    "CatalogError",
    "DatacatError",
    "Entry",
    "EntryNotFound",
    "Format",
    "JaxOptions",
    "LoadOptions",
    "Loader",
    "OptionError",
    "Plan",
    "Section",
    "ShardCache",
    "ShardError",
    "TorchOptions",
    "describe",
    "load_catalog",
    "open",
    "register_format",
    "resolve",
]
__version__ = "0.1.0"
