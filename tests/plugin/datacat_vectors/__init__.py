"""The ``vectors`` format: rows of a key, a caption and a vector, one JSON object per line of ``.jsonl`` shards.

A test plugin: a format datacat does not ship, declared through the
``datacat.formats`` entry point. Its entries have their own section::

    vectors:
      dim: 8            # values per vector
      dtype: float32

and its batches have no image: ``key``, ``caption`` and ``vector`` ``[B, dim]``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from datacat import Format, Plan, Section
from datacat.formats import RawItem, check_declared
from datacat.plan import ShardFacts
from datacat.schema import PositiveInt
from datacat.storage import read_bytes

__all__ = ["FORMAT", "Vectors", "VectorsReader"]


class Vectors(Section):
    """How a ``vectors`` entry's rows are laid out."""

    dim: PositiveInt
    """Values in each row's vector."""
    dtype: Literal["float16", "float32"] = "float32"
    """The dtype of the batch's ``vector`` array."""


def _options(plan: Plan) -> Vectors:
    if not isinstance(plan.options, Vectors):
        raise ValueError(f"{plan.name}: a vectors entry needs its vectors section")
    return plan.options


def _lines(url: str, storage_options: Mapping[str, Any]) -> list[bytes]:
    return [line for line in read_bytes(url, dict(storage_options)).split(b"\n") if line.strip()]


class VectorsReader:
    """Rows by global index: shards in plan order, lines in file order (each shard read whole at open)."""

    random_access: Literal[True] = True

    def __init__(self, plan: Plan) -> None:
        self.name, self.options = plan.name, _options(plan)
        self.urls = [s.url for s in plan.shards]
        self.lines = [_lines(url, plan.storage_options) for url in self.urls]
        self.counts = [len(lines) for lines in self.lines]
        check_declared(self.urls, [s.samples for s in plan.shards], self.counts, holds="has {} lines")
        self.starts = [0]
        for count in self.counts:
            self.starts.append(self.starts[-1] + count)

    def __len__(self) -> int:
        return self.starts[-1]

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]:
        out: list[RawItem | Exception] = []
        for index in indices:
            shard = max(i for i, start in enumerate(self.starts[:-1]) if start <= index)
            line = index - self.starts[shard]
            out.append(RawItem(f"{shard}:{line}", self.urls[shard], index, self.lines[shard][line]))
        return out

    def parse(self, item: RawItem) -> dict[str, Any]:
        import numpy as np

        row = json.loads(item.payload)  # a JSONDecodeError is a ValueError: a bad record for the ledger
        vector = np.asarray(row["vector"], dtype=self.options.dtype)
        if vector.shape != (self.options.dim,):
            raise ValueError(f"its vector has {vector.size} values, the entry's vectors.dim is {self.options.dim}")
        return {
            "__key__": str(row["key"]),
            "__shard__": item.shard,
            "__uid__": item.uid,
            "caption": row.get("caption"),
            "vector": vector,
        }


def _contract(plan: Plan) -> list[str]:
    dim = plan.options.dim if isinstance(plan.options, Vectors) else "dim"
    return [f"Each shard is a .jsonl file: one JSON object per line with key, caption and vector ({dim} numbers)."]


def _shard_facts(plan: Plan, sizes: Mapping[str, int]) -> Callable[[int], ShardFacts]:
    def count(i: int) -> ShardFacts:
        shard = plan.shards[i]
        return ShardFacts(shard.name, len(_lines(shard.url, plan.storage_options)), url=shard.url)

    return count


FORMAT = Format(
    VectorsReader,
    "random",
    ("lines",),
    _contract,
    section="vectors",
    options=Vectors,
    arrays=("vector",),
    rows=True,
    shard_facts=_shard_facts,
    names_a_shard=lambda name: name.endswith(".jsonl"),
    shards_are="its shards are .jsonl files",
    doc=__doc__ or "",
)
