"""Which formats and backends exist, and where their code lives.

Like fsspec's ``known_implementations``: a name maps to ``"module:Class"``
and an install hint, and the module is imported on first use only, so
``import datacat`` costs none of the heavy readers or frameworks. Adding a
format is a module under ``datacat/formats/`` plus one line here; the
``format:`` value in a catalog file is the key.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Literal

from datacat.errors import BackendUnavailable

__all__ = ["BACKENDS", "FORMATS", "FormatInfo", "Implementation", "load_implementation"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """Where a format reader or backend lives, and how to install what it needs."""

    target: str
    hint: str = ""


@dataclasses.dataclass(frozen=True)
class FormatInfo(Implementation):
    """A format's reader plus what a catalog entry of that format must declare.

    ``access`` is ``"random"`` for formats read by index (array_record, image
    lists), ``"indexed"`` for tar shards (read by index through a byte index
    of their members, built on first read or by ``datacat verify``; a gzip tar
    is read front to back) and ``"stream"`` for formats read front to back.
    ``needs`` names the entry sections the format cannot do without, and
    ``layouts`` the ``record.layout`` values it reads.
    """

    access: Literal["random", "indexed", "stream", "composite"] = "stream"
    needs: tuple[str, ...] = ()
    layouts: tuple[str, ...] = ()


_AR_HINT = "array_record shards need array-record: pip install array-record"

FORMATS: dict[str, FormatInfo] = {
    "webdataset": FormatInfo("datacat.formats.webdataset:WebDatasetReader", "", "indexed", ("location",), ("members",)),
    "array_record": FormatInfo(
        "datacat.formats.array_record:ArrayRecordReader",
        _AR_HINT,
        "random",
        ("location",),
        ("packed", "pre_resized", "single", "tf_example"),
    ),
    "image_folder": FormatInfo(
        "datacat.formats.image_folder:ImageFolderReader", "", "random", ("location",), ("files",)
    ),
    "image_list": FormatInfo("datacat.formats.image_list:ImageListReader", "", "random", ("location",), ("table",)),
    "huggingface": FormatInfo(
        "datacat.formats.huggingface:HuggingFaceReader",
        "Hugging Face datasets need the datasets library: pip install 'datacat[hf]'",
        "random",
        ("location",),
        ("rows",),
    ),
    "embeddings": FormatInfo(
        "datacat.formats.embeddings:EmbeddingsReader", "", "stream", ("location", "embeddings"), ("members",)
    ),
    "embedding_table": FormatInfo(
        "datacat.formats.embedding_table:EmbeddingTableReader",
        "Embedding tables need numpy and pyarrow: pip install 'datacat[images,parquet]'",
        "random",
        ("location", "prior"),
        ("rows",),
    ),
    "mixture": FormatInfo("datacat.mixing:MixtureSource", "", "composite", ("mixture",), ()),
}

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
