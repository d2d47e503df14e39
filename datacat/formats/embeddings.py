"""DALLE2-pytorch embedding folders: ``img_emb_NNNN.npy`` aligned row by row with tar shard NNNN.

A record key's first ``shard_width`` digits are its shard number and the
rest its row in that shard's ``.npy`` (``00030509`` is shard 3, row 509).
The reader streams the image entry's tar shards and attaches each sample's
embedding, checking that the key belongs to the shard it was found in.
"""

from __future__ import annotations

import io
import posixpath
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from datacat.errors import ShardError
from datacat.formats import RawItem
from datacat.formats.webdataset import TarStream
from datacat.registry import Format
from datacat.storage import read_bytes

if TYPE_CHECKING:
    import numpy as np

    from datacat.plan import Plan

__all__ = ["FORMAT", "EmbeddingsReader"]


class EmbeddingsReader:
    """Samples of the aligned image shards, each with its ``embedding`` row: a stream reader."""

    random_access: Literal[False] = False
    counts: tuple[int, ...] = ()

    def __init__(self, plan: Plan) -> None:
        if plan.images is None or plan.embeddings is None:
            raise ShardError(f"{plan.name}: an embeddings entry needs embeddings.images, the entry of its tar shards")
        self.name = plan.name
        self.spec = plan.embeddings
        self.images = TarStream(plan.images)  # read shard by shard, aligned with the files
        self.storage_options = dict(plan.storage_options)
        self.files = {self._number(s.name, self.spec.prefix): s.url for s in plan.shards}
        # Shard i of this entry (its records counted in plan.shards[i]) is read from tar shard i: they must pair up.
        embedded = [self._number(s.name, self.spec.prefix) for s in plan.shards]
        imaged = [self._number(url) for url in self.images.urls]
        if embedded != imaged:
            raise ShardError(
                f"{plan.name}: its embedding files are for shards {embedded}, but {plan.images.name} has tar shards "
                f"{imaged}; declare the same missing shards in both entries"
            )
        self._loaded: tuple[int, np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"EmbeddingsReader({self.name!r}, files={len(self.files)}, images={self.images!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_loaded": None}

    @staticmethod
    def _number(name: str, prefix: str = "") -> int:
        stem = posixpath.basename(name)
        stem = stem[len(prefix) :] if prefix and stem.startswith(prefix) else stem
        match = re.match(r"\d+", stem)
        if match is None:
            raise ShardError(f"cannot read a shard number from {name!r}")
        return int(match.group())

    def iter_shard(self, index: int) -> Iterator[RawItem]:
        """The raw samples of image shard ``index``, carrying its shard number for alignment."""
        number = self._number(self.images.urls[index])
        for item in self.images.iter_shard(index):
            yield RawItem(item.key, item.shard, item.uid, (number, item.payload))

    def _table(self, number: int) -> np.ndarray:
        if self._loaded is None or self._loaded[0] != number:
            url = self.files.get(number)
            if url is None:
                raise ShardError(
                    f"{self.name}: no embedding file for image shard {number} ({self.spec.prefix}{number:0{self.spec.shard_width}d}.npy)"
                )
            import numpy as np

            array = np.load(io.BytesIO(read_bytes(url, self.storage_options)), allow_pickle=False)
            if array.ndim != 2 or array.shape[1] != self.spec.dim:
                raise ShardError(
                    f"{url} has shape {array.shape}, the catalog declares [records, {self.spec.dim}]", url=url
                )
            self._loaded = (number, array.astype(self.spec.dtype, copy=False))
        return self._loaded[1]

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The sample's record with its embedding row attached."""
        number, fields = item.payload
        record = self.images.parse(RawItem(item.key, item.shard, item.uid, fields))
        base = posixpath.basename(item.key)
        width = self.spec.shard_width
        if not base[:width].isdigit() or int(base[:width]) != number or not base[width:].isdigit():
            raise ValueError(
                f"key {item.key!r} does not start with shard number {number:0{width}d} followed by a row index"
            )
        row = int(base[width:])
        table = self._table(number)
        if row >= len(table):
            raise ValueError(f"key {item.key!r} names row {row}, but the shard's embedding file has {len(table)} rows")
        record["embedding"] = table[row]
        return record


def _contract(plan: Plan) -> list[str]:
    emb = plan.embeddings
    if emb is None:
        return []
    return [
        f"Shard N of {emb.images or 'the image entry'} has a file {emb.prefix}"
        f"{'N'.zfill(emb.shard_width)}.npy of shape [records, {emb.dim}], dtype {emb.dtype}.",
        f"A record key's first {emb.shard_width} digits are its shard number and the rest its row in that file.",
    ]


FORMAT = Format(
    EmbeddingsReader, "stream", ("members",), _contract, needs=("location", "embeddings"), sections=("embeddings",)
)
