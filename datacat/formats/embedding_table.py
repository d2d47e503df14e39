"""Embedding tables for a diffusion prior: row-aligned ``.npy`` and parquet files, as clip-retrieval writes them.

Shard ``0003`` is three files under the root: ``img_emb/img_emb_0003.npy``,
``text_emb/text_emb_0003.npy`` (for a text-conditioned prior) and
``metadata/metadata_0003.parquet`` (its ``caption`` column). A record is one
row: ``image_embedding``, ``text_embedding`` and ``caption`` as the entry's
``prior`` section asks, the embeddings in the table's own dtype (cast
them on the device: numpy's float16 cast is ~20x slower than a copy). Rows are read by exact byte range (``.npy`` rows
are fixed-size after the header), a batch's rows at once, locally by
``pread`` and remotely through fsspec, so the Feistel shuffle and every
guarantee of the random-access formats apply.

At open each shard's files are checked against each other and the entry:
the ``.npy`` headers (never unpickled: an object array is refused) say
rows, width and dtype; the parquet footer says rows. An all-zero image
embedding (a row clip-retrieval could not embed) is a bad sample for the
ledger. The split is by global rows declared in the entry
(``prior.validation_rows``), so it does not move when the world size does.
"""

from __future__ import annotations

import ast
import bisect
import concurrent.futures
import itertools
import posixpath
import struct
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

from datacat.errors import ShardError
from datacat.formats import RawItem, check_declared
from datacat.formats.table_rows import rows_fill
from datacat.registry import Format
from datacat.schema import NonNegativeInt, PositiveInt, Section
from datacat.storage import object_size, open_url, read_ranges

if TYPE_CHECKING:
    import numpy as np

    from datacat.plan import Plan

__all__ = ["FORMAT", "EmbeddingTableReader", "Prior", "npy_header", "prior_of"]

CAPTION_BUDGET = 1 << 30
"""Bytes of captions a process keeps (arrow arrays, every shard a batch touches); past it the oldest shard's go."""
_HEAD = 4096
"""Bytes read for a ``.npy`` header: enough for any header numpy writes for a 2-d array."""
_PARSING = threading.Lock()
"""One header parsed at a time: CPython 3.11 builds an AST with one recursion count for all threads, and two
threads building at once can raise ``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905;
seen here opening a table's shards in threads beside jax's)."""


def npy_header(head: bytes, url: str) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """(shape, dtype, data offset) of a ``.npy`` file from its first bytes; refuses pickled (object) arrays."""
    import numpy as np

    if head[:6] != b"\x93NUMPY":
        raise ShardError(f"{url} is not a .npy file (no NUMPY magic); re-write it with numpy.save", url=url)
    major = head[6]
    if major == 1:
        (length,), start = struct.unpack("<H", head[8:10]), 10
    else:
        (length,), start = struct.unpack("<I", head[8:12]), 12
    try:
        with _PARSING:
            header = ast.literal_eval(head[start : start + length].decode("latin1"))  # a literal dict, never code
        dtype = np.dtype(header["descr"])
        shape = tuple(int(n) for n in header["shape"])
        fortran = bool(header["fortran_order"])
    except (ValueError, SyntaxError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ShardError(f"{url} has a damaged .npy header ({exc}); re-write it", url=url) from None
    if dtype.hasobject:
        raise ShardError(
            f"{url} holds Python objects (a pickled .npy); datacat never unpickles: save plain float arrays",
            url=url,
        )
    if fortran and len(shape) > 1 and shape[0] > 1:
        raise ShardError(f"{url} is Fortran-ordered; rows are not contiguous. Save it C-ordered", url=url)
    return shape, dtype, start + length


class Prior(Section):
    """Embedding tables as clip-retrieval writes them, for a diffusion prior (DALLE2-pytorch's `PriorEmbeddingDataset`).

    Shard `0003` is `img_emb/img_emb_0003.npy`, `text_emb/text_emb_0003.npy` and
    `metadata/metadata_0003.parquet` under the root, row-aligned; a record is one row.
    """

    dim: PositiveInt
    """Embedding width, of image and text alike (768 for ViT-L/14)."""
    dtype: Literal["float16", "float32", "float64"] = "float16"
    text: bool = True
    """Text-conditioned: read `text_emb` beside `img_emb` (false: the unconditioned prior, image side only)."""
    captions: bool = True
    """Read each row's `caption` from `metadata/metadata_NNNN.parquet`."""
    validation_rows: tuple[NonNegativeInt, NonNegativeInt] | None = None
    """Global rows `[start, end)` (over the shards in order) that are the validation split; training reads
    every other row. Declared here, the split is the same for any world size."""


def prior_of(plan: Plan) -> Prior:
    """The ``prior`` section of an embedding_table plan."""
    if not isinstance(plan.options, Prior):
        raise ShardError(f"{plan.name}: an embedding_table entry needs its prior section")
    return plan.options


class EmbeddingTableReader:
    """Rows of an entry's embedding tables by index: this split's rows only, shards in order."""

    random_access: Literal[True] = True

    def __init__(self, plan: Plan) -> None:
        import numpy as np

        self.name, self.prior = plan.name, prior_of(plan)
        self.storage_options = dict(plan.storage_options)
        self.shards = tuple(s.name for s in plan.shards)
        root = plan.root.rstrip("/")
        self.images = tuple(posixpath.join(root, "img_emb", f"img_emb_{n}.npy") for n in self.shards)
        self.texts = tuple(posixpath.join(root, "text_emb", f"text_emb_{n}.npy") for n in self.shards)
        self.metadata = tuple(posixpath.join(root, "metadata", f"metadata_{n}.parquet") for n in self.shards)
        self.dtype = np.dtype(self.prior.dtype)
        self.row_bytes = self.prior.dim * self.dtype.itemsize
        with concurrent.futures.ThreadPoolExecutor(min(16, max(1, len(self.shards)))) as pool:
            opened = list(pool.map(self._open_shard, range(len(self.shards))))
        self.rows = tuple(n for n, _, _, _ in opened)
        self.counts = self.rows  # rows per shard, both splits: what `datacat count` prints
        self.image_offsets = tuple(o for _, o, _, _ in opened)
        self.text_offsets = tuple(t for _, _, t, _ in opened)
        self.captions_fit = sum(c for _, _, _, c in opened) <= CAPTION_BUDGET
        """Whether every shard's captions together fit the budget (a batch path keeps them as one array)."""
        check_declared(self.images, [s.samples for s in plan.shards], self.rows, holds="has {} rows")
        self.starts = tuple(itertools.accumulate(self.rows, initial=0))
        total = self.starts[-1]
        held = self.prior.validation_rows
        if held is not None and not 0 <= held[0] <= held[1] <= total:
            raise ShardError(f"{plan.name}: prior.validation_rows {list(held)} is outside the {total} rows there are")
        lo, hi = held if held is not None else (0, 0)
        # This split's rows as (first global row, length) segments.
        if plan.split == "validation" and held is not None:
            self.segments: tuple[tuple[int, int], ...] = ((lo, hi - lo),)
        else:
            self.segments = tuple((a, b - a) for a, b in ((0, lo), (hi, total)) if b > a)
        self.segment_starts = tuple(itertools.accumulate((n for _, n in self.segments), initial=0))
        self._captions: dict[int, Any] = {}  # shard -> its captions (an arrow array)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EmbeddingTableReader({self.name!r}, shards={len(self.shards)}, rows={len(self)})"

    def __len__(self) -> int:
        return self.segment_starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_captions": {}, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _open_shard(self, i: int) -> tuple[int, int, int, int]:
        # Rows, the data offsets of the image and text arrays and the captions' bytes, after checking the files agree.
        urls = [self.images[i]] + ([self.texts[i]] if self.prior.text else [])
        found = []
        for url in urls:
            try:
                size = object_size(url, self.storage_options)
            except FileNotFoundError:
                raise FileNotFoundError(
                    2, f"{url} not found: shard {self.shards[i]} needs img_emb, text_emb and metadata files", url
                ) from None
            (head,) = read_ranges([(url, 0, min(size, _HEAD))], self.storage_options)
            if isinstance(head, Exception):
                raise head
            shape, dtype, offset = npy_header(head, url)
            if len(shape) == 2 and size != offset + shape[0] * shape[1] * dtype.itemsize:
                raise ShardError(
                    f"{url} is {size} bytes, its header promises {list(shape)} {dtype}: truncated? Re-copy it", url=url
                )
            if len(shape) != 2 or shape[1] != self.prior.dim or dtype != self.dtype:
                raise ShardError(
                    f"{url} holds {dtype} {list(shape)}, the entry declares {self.prior.dtype} [rows, {self.prior.dim}]",
                    url=url,
                )
            found.append((shape[0], offset))
        rows = found[0][0]
        if self.prior.text and found[1][0] != rows:
            raise ShardError(
                f"{self.texts[i]} has {found[1][0]} rows, {self.images[i]} has {rows}: the tables are not aligned",
                url=self.texts[i],
            )
        caption_bytes = 0
        if self.prior.captions:
            meta_rows, caption_bytes = self._metadata_rows(i)
            if meta_rows != rows:
                raise ShardError(
                    f"{self.metadata[i]} has {meta_rows} rows, {self.images[i]} has {rows}: the tables are not aligned",
                    url=self.metadata[i],
                )
        return rows, found[0][1], found[1][1] if self.prior.text else 0, caption_bytes

    def _metadata_rows(self, i: int) -> tuple[int, int]:
        # Rows, and the caption column's bytes uncompressed, from the parquet footer.
        import pyarrow.parquet as pq  # the parquet extra

        try:
            with open_url(self.metadata[i], self.storage_options) as f:
                parquet = pq.ParquetFile(f)
                if "caption" not in parquet.schema_arrow.names:
                    raise ShardError(f"{self.metadata[i]} has no caption column", url=self.metadata[i])
                meta = parquet.metadata
                column = parquet.schema_arrow.names.index("caption")
                size = sum(meta.row_group(g).column(column).total_uncompressed_size for g in range(meta.num_row_groups))
                return int(meta.num_rows), int(size)
        except FileNotFoundError:
            raise FileNotFoundError(
                2, f"{self.metadata[i]} not found (set prior.captions: false if there is none)", self.metadata[i]
            ) from None

    def _caption_column(self, i: int) -> Any:
        """Shard ``i``'s captions as one arrow string array (nulls as ""), kept while they fit the budget."""
        captions = self._captions.get(i)
        if captions is None:
            captions = self.read_captions(i)
            with self._lock:
                # Batches drawn from the whole table touch every shard: keep every shard's captions the
                # budget holds (arrow keeps a column as one buffer), dropping the oldest past it.
                self._captions[i] = captions
                while len(self._captions) > 1 and sum(c.nbytes for c in self._captions.values()) > CAPTION_BUDGET:
                    self._captions.pop(next(iter(self._captions)))
        return captions

    def read_captions(self, i: int) -> Any:
        """Shard ``i``'s captions read from its parquet file: one arrow string array, nulls as ""."""
        import pyarrow.parquet as pq

        with open_url(self.metadata[i], self.storage_options) as f:  # seekable: only the caption column is read
            column = pq.ParquetFile(f).read(columns=["caption"]).column("caption").combine_chunks()
        if column.null_count:
            import pyarrow.compute as pc  # ~0.25 s to import: only for a column that has nulls

            column = pc.fill_null(column, "")
        return column

    def locate(self, index: int) -> tuple[int, int]:
        """(shard, row in shard) of this split's record ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} is outside 0..{len(self) - 1} of {self.name}")
        segment = bisect.bisect_right(self.segment_starts, index) - 1
        row = self.segments[segment][0] + index - self.segment_starts[segment]
        shard = bisect.bisect_right(self.starts, row) - 1
        return shard, row - self.starts[shard]

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]:
        """The rows at ``indices``, their byte ranges fetched at once."""
        where = [self.locate(i) for i in indices]
        requests = [
            (
                self.images[s],
                self.image_offsets[s] + r * self.row_bytes,
                self.image_offsets[s] + (r + 1) * self.row_bytes,
            )
            for s, r in where
        ]
        if self.prior.text:
            requests += [
                (
                    self.texts[s],
                    self.text_offsets[s] + r * self.row_bytes,
                    self.text_offsets[s] + (r + 1) * self.row_bytes,
                )
                for s, r in where
            ]
        data = read_ranges(requests, self.storage_options)
        out: list[RawItem | Exception] = []
        for k, (index, (shard, row)) in enumerate(zip(indices, where, strict=True)):
            image = data[k]
            text = data[len(where) + k] if self.prior.text else None
            failed = next((d for d in (image, text) if isinstance(d, Exception)), None)
            if failed is not None:
                out.append(failed)
                continue
            caption = self._caption_column(shard)[row].as_py() if self.prior.captions else None
            out.append(RawItem(f"{self.shards[shard]}:{row}", self.images[shard], index, (image, text, caption)))
        return out

    def parse(self, item: RawItem) -> dict[str, Any]:
        """The record of one row: its embeddings in the table's dtype and its caption; an all-zero image row is refused."""
        import numpy as np

        image, text, caption = item.payload
        out: dict[str, Any] = {"__key__": item.key, "__shard__": item.shard, "__uid__": item.uid}
        if not np.frombuffer(image, np.uint8).any():
            raise ValueError("its image embedding is all zeros (a row the embedding job could not compute)")
        out["image_embedding"] = np.frombuffer(image, dtype=self.dtype).copy()
        if text is not None:
            out["text_embedding"] = np.frombuffer(text, dtype=self.dtype).copy()
        if self.prior.captions:
            out["caption"] = str(caption or "")
        return out


def _names_a_number(shard: str) -> bool:
    return not shard.lower().endswith(
        (".jpg", ".jpeg", ".png", ".webp", ".tar", ".csv", ".tsv", ".parquet", ".array_record", ".npy")
    )


def _contract(plan: Plan) -> list[str]:
    if not isinstance(prior := plan.options, Prior):
        return []
    lines = [
        f"Shard N is img_emb/img_emb_N.npy, a plain (never pickled) {prior.dtype} array [rows, {prior.dim}]"
        + (", text_emb/text_emb_N.npy of the same shape" if prior.text else "")
        + (", and metadata/metadata_N.parquet with a caption column" if prior.captions else "")
        + ": row-aligned, as clip-retrieval writes them. A row whose image embedding is all zeros is a bad sample."
    ]
    if prior.validation_rows is not None:
        lo, hi = prior.validation_rows
        lines.append(f"Global rows [{lo:,}, {hi:,}) are the validation split; training reads every other row.")
    return lines


def _declares_validation(options: BaseModel) -> bool:
    return isinstance(options, Prior) and options.validation_rows is not None


FORMAT = Format(
    EmbeddingTableReader,
    "random",
    ("rows",),
    _contract,
    section="prior",
    options=Prior,
    arrays=("image_embedding", "text_embedding"),
    val_batches=False,
    own_validation=_declares_validation,
    names_a_shard=_names_a_number,
    shards_are='its shards are file numbers, e.g. shards: "{0000..0009}" for img_emb/img_emb_0000.npy ...',
    rows=True,
    fill=rows_fill,
    hint="Embedding tables need numpy and pyarrow: pip install 'datacat[images,parquet]'",
    doc=__doc__ or "",
)
