"""The storage layer: every read datacat makes of shards, listings and its cache, behind one error mapping.

Modules, by concept: :mod:`~datacat.storage.errors` (storage libraries'
exceptions mapped to datacat's, by type), :mod:`~datacat.storage.retry`
(the one retry loop and its deadline), :mod:`~datacat.storage.clients`
(fsspec filesystems), :mod:`~datacat.storage.files` (streams, byte ranges,
whole objects, local files kept open), :mod:`~datacat.storage.listing`
(globs), :mod:`~datacat.storage.manifests` (the manifest cache),
:mod:`~datacat.storage.plans` (a Plan completed from storage),
:mod:`~datacat.storage.shard_cache` (remote shards kept on a local disk) and
:mod:`~datacat.storage.shard_fill` (a loader filling it). Nothing here
knows a format, a transform or a framework.
"""

from datacat.storage.clients import filesystem, is_remote
from datacat.storage.errors import Meaning, classify, mapped_errors
from datacat.storage.files import BLOCK_SIZE, object_size, open_url, read_bytes, read_many, read_ranges
from datacat.storage.listing import list_glob
from datacat.storage.plans import complete_plan
from datacat.storage.retry import RETRIES, retry_count, with_retries

__all__ = [
    "BLOCK_SIZE",
    "RETRIES",
    "Meaning",
    "classify",
    "complete_plan",
    "filesystem",
    "is_remote",
    "list_glob",
    "mapped_errors",
    "object_size",
    "open_url",
    "read_bytes",
    "read_many",
    "read_ranges",
    "retry_count",
    "with_retries",
]
