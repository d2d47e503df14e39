"""Which formats and backends exist, and where their code lives.

Like fsspec's ``known_implementations``: a name maps to where its code lives,
and the module is imported on first use only, so ``import datacat`` costs
none of the readers or frameworks. A format is one module under
``datacat/formats/`` ending in a :class:`Format` declaration named
``FORMAT`` (its layouts, the rules its files follow, how its shards are
named and counted, its reader), plus one line in :data:`FORMATS`; the
``format:`` value in a catalog file is the key. Format modules import their
heavy libraries (numpy, fsspec, array_record) where they read, so that
validating and describing an entry imports none of them.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from datacat.errors import BackendUnavailable

if TYPE_CHECKING:
    from datacat.plan import Plan

__all__ = ["BACKENDS", "FORMATS", "Format", "Implementation", "format_of", "load_implementation"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """Where a backend lives (``"module:attribute"``), and how to install what it needs."""

    target: str
    hint: str = ""


def _any_name(shard: str) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Format:
    """One ``format:`` value: what its catalog entries declare and how its records are read.

    ``access`` is ``"random"`` for formats read by index (array_record, image
    lists), ``"indexed"`` for tar shards (read by index through a byte index
    of their members, built on first read or by ``datacat verify``; a gzip tar
    is read front to back), ``"stream"`` for formats read front to back and
    ``"composite"`` for mixtures. ``needs`` names the entry sections the
    format cannot do without (and ``sections`` those only it may have),
    ``layouts`` the ``record.layout`` values it reads, the first being the
    default. ``contract(plan)`` is what ``datacat describe`` prints: the rules
    the files follow, one sentence each. ``names_a_shard`` tells a shard
    name of this format from a mistake; ``shards_are`` says what one is.
    ``counted`` says how ``datacat count`` counts: per shard, or not at all
    (records counted when the entry is opened). ``rows`` marks a format
    whose records are embedding rows, not images. ``used_here`` is set for a
    format whose native library a forked child cannot use once its parent
    has: it tells whether this process has loaded it (worker processes then
    start from a forkserver).
    """

    reader: Callable[[Plan], Any]
    access: Literal["random", "indexed", "stream", "composite"]
    layouts: tuple[str, ...]
    contract: Callable[[Plan], list[str]]
    needs: tuple[str, ...] = ("location",)
    sections: tuple[str, ...] = ()
    names_a_shard: Callable[[str], bool] = _any_name
    shards_are: str = ""
    counted: Literal["per_shard", "at_open"] = "per_shard"
    rows: bool = False
    used_here: Callable[[], bool] | None = None
    hint: str = ""


FORMATS: dict[str, str] = {
    "webdataset": "datacat.formats.webdataset",
    "array_record": "datacat.formats.array_record",
    "image_folder": "datacat.formats.image_folder",
    "image_list": "datacat.formats.image_list",
    "huggingface": "datacat.formats.huggingface",
    "embeddings": "datacat.formats.embeddings",
    "embedding_table": "datacat.formats.embedding_table",
    "mixture": "datacat.mixing",
}
"""Each ``format:`` value and the module whose ``FORMAT`` declares it."""


def _open_mixture(plan: Plan) -> Any:
    from datacat.mixing import MixtureSource

    return MixtureSource(plan)


def _mixture_contract(plan: Plan) -> list[str]:
    return [f"Each component ({', '.join(c.plan.name for c in plan.components)}) follows its own contract."]


# A mixture reads other entries; its declaration lives here, so that validating one imports no reader.
_BUILT_IN = {
    "mixture": Format(
        _open_mixture, "composite", (), _mixture_contract, needs=("mixture",), sections=("mixture",), counted="at_open"
    )
}
_LOADED: dict[str, Format] = {}


def format_of(name: str) -> Format:
    """The declaration of format ``name`` (a key of :data:`FORMATS`), its module imported now."""
    found = _LOADED.get(name) or _BUILT_IN.get(name)
    if found is None:
        module = importlib.import_module(FORMATS[name])
        found = _LOADED[name] = module.FORMAT
    return found


BACKENDS: dict[str, Implementation] = {
    "torch": Implementation(
        "datacat.backends.torch:open_torch",
        "The torch backend needs torch and webdataset: pip install 'datacat[torch]'",
    ),
    "jax": Implementation(
        "datacat.backends.jax:open_jax", "The jax backend needs jax and grain: pip install 'datacat[jax]'"
    ),
}


def load_implementation(impl: Implementation) -> Any:
    """The object ``impl.target`` names, imported now; a missing dependency names its extra."""
    module_name, _, attr = impl.target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if impl.hint and exc.name and not exc.name.startswith("datacat"):
            raise BackendUnavailable(f"{impl.hint} ({exc.name} is not installed)") from exc
        raise
    return getattr(module, attr)
