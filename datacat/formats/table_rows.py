"""Embedding-table rows read a batch at a time: each array gathered from its memory-mapped ``.npy`` into the batch."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from datacat.formats import Filled, Reader
from datacat.storage import is_remote

if TYPE_CHECKING:
    import numpy as np

    from datacat.formats.embedding_table import EmbeddingTableReader
    from datacat.plan import Plan

__all__ = ["RowsFill", "rows_fill"]


class RowsFill:
    """Batches of a local embedding table: each array's rows gathered from its memory-mapped ``.npy`` into the batch.

    One numpy gather per array and shard of the batch (a copy, converted to
    float32 on the way, that lets the GIL go); only keys and captions are
    made per row. A row whose image embedding is all zeros is left to the
    record path, which ledgers it.
    """

    def __init__(self, reader: EmbeddingTableReader) -> None:
        import numpy as np

        self.reader = reader
        self.dim = reader.prior.dim
        self.segment_starts = np.asarray(reader.segment_starts, dtype=np.int64)
        self.segment_firsts = np.asarray([first for first, _ in reader.segments] + [0], dtype=np.int64)
        self.shard_starts = np.asarray(reader.starts, dtype=np.int64)
        self._maps: dict[tuple[str, int], np.ndarray] = {}

    def __repr__(self) -> str:
        return f"RowsFill({self.reader.name!r}, dim={self.dim})"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}}  # each process maps the files itself

    @property
    def arrays(self) -> Mapping[str, tuple[tuple[int, ...], str]]:
        keys = ("image_embedding", "text_embedding") if self.reader.prior.text else ("image_embedding",)
        return {key: ((self.dim,), "float32") for key in keys}

    def _map(self, key: str, shard: int) -> np.ndarray:
        found = self._maps.get((key, shard))
        if found is None:
            import numpy as np

            reader = self.reader
            image = key == "image_embedding"
            url = reader.images[shard] if image else reader.texts[shard]
            offset = reader.image_offsets[shard] if image else reader.text_offsets[shard]
            found = np.memmap(url, dtype=reader.dtype, mode="r", offset=offset, shape=(reader.rows[shard], self.dim))
            self._maps[(key, shard)] = found
        return found

    def fill(self, positions: Sequence[int], out: Mapping[str, np.ndarray]) -> Filled:
        """The rows at ``positions`` of this split into ``out``'s arrays; their keys and captions."""
        import numpy as np

        index = np.asarray(positions, dtype=np.int64)
        segment = np.searchsorted(self.segment_starts, index, side="right") - 1
        rows = self.segment_firsts[segment] + index - self.segment_starts[segment]
        shards = np.searchsorted(self.shard_starts, rows, side="right") - 1
        local = rows - self.shard_starts[shards]
        present = np.unique(shards)
        for key, buffer in out.items():
            for shard in present.tolist():
                table = self._map(key, shard)
                if len(present) == 1:
                    buffer[...] = table[local]
                else:
                    chosen = np.flatnonzero(shards == shard)
                    buffer[chosen] = table[local[chosen]]
        names = self.reader.shards
        shard_list, local_list = shards.tolist(), local.tolist()
        fields: dict[str, list[Any]] = {"key": [f"{names[s]}:{r}" for s, r in zip(shard_list, local_list, strict=True)]}
        if self.reader.prior.captions:
            missing = [s for s in present.tolist() if s not in self.reader._captions]
            if len(missing) > 1:  # a shuffled batch touches every shard: its caption columns read side by side
                with concurrent.futures.ThreadPoolExecutor(min(8, len(missing))) as pool:
                    list(pool.map(self.reader._caption_column, missing))
            captions: list[Any] = [None] * len(positions)
            for shard in present.tolist():
                chosen = np.flatnonzero(shards == shard)
                values = self.reader._caption_column(shard).take(local[chosen]).to_pylist()
                for slot, value in zip(chosen.tolist(), values, strict=True):
                    captions[slot] = value
            fields["caption"] = captions
        zero = np.flatnonzero(~out["image_embedding"].any(axis=1))
        return Filled(fields, dict.fromkeys(zero.tolist()))


def rows_fill(reader: Reader, plan: Plan) -> RowsFill | None:
    """The batch path of an embedding_table plan: local tables, else None (rows one by one)."""
    from datacat.formats.embedding_table import EmbeddingTableReader

    if not isinstance(reader, EmbeddingTableReader) or any(is_remote(url) for url in reader.images[:1]):
        return None
    return RowsFill(reader)
