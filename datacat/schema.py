"""What a catalog entry may say: frozen pydantic models, unknown keys refused.

An entry describes one dataset as it lies in storage (where, how many shards,
how big, which are missing, how a record is laid out) and how it is loaded by
default. Structure and types are checked here; rules that relate fields to
each other (missing shards inside the pattern, declared counts, mixture
references) are checked by :mod:`datacat.rules`, which can report them all at
once with their key paths.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ByteSize, ConfigDict, Field

__all__ = [
    "Augmentation",
    "BadSamplePolicy",
    "Captions",
    "Component",
    "Embeddings",
    "Entry",
    "Exhaustion",
    "Loading",
    "Location",
    "Mixture",
    "Prior",
    "Record",
    "ResizeMode",
    "Totals",
]

Augmentation = Literal["none", "flip_only", "flip_jitter"]
ResizeMode = Literal["center_crop", "squash", "pad"]
BadSamplePolicy = Literal["raise", "skip"]
Exhaustion = Literal["stop_on_first", "stop_on_all", "restart"]

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class Location(_Frozen):
    """Where the shards of one split lie."""

    root: str
    """Any fsspec URL or local path; relative paths are taken from the catalog file's folder.
    `${VAR}` and `${VAR:-default}` are replaced from the environment."""
    path: str = ""
    """Sub-folder under root holding the shards, e.g. `arrayrecord2/cc3m`."""
    shards: str | tuple[str, ...]
    """A brace pattern (`{00000..00049}.array_record`), a glob (`*.tar`, listed when loaded) or an explicit list."""
    missing: tuple[int | str, ...] = ()
    """Shards the pattern names that do not exist: numbers of the brace range, or shard names."""
    storage_options: dict[str, Any] = {}
    """Passed to fsspec; string values may use `${VAR}` / `${VAR:-default}`."""
    samples: NonNegativeInt | None = None
    """Records in this split, as declared (for a split under `splits`; the entry's own is `totals.samples`)."""


class Totals(_Frozen):
    """What the dataset declares about its size; `describe` and the resolver report it."""

    shards: NonNegativeInt | None = None
    """Shards that exist: the pattern's count minus the missing ones."""
    samples: NonNegativeInt | None = None
    """Records in all shards (approximate unless `per_shard` gives every shard)."""
    bytes: ByteSize | None = None
    """Total size; accepts `37 GiB`, `550GB` or a plain number of bytes."""
    per_shard: dict[str, NonNegativeInt] | None = None
    """Records per shard, by shard name; lets a loader plan without opening every shard."""


class Record(_Frozen):
    """How one record is laid out: which key holds what."""

    layout: str | None = None
    """One of the layouts the format declares (a wrong one is an error listing them); unset means its first: `members` (tar members by extension), `packed` (array_record length-prefixed dict),
    `pre_resized` (array_record `image`/`shape`/`caption`), `single` (one blob per record),
    `tf_example` (array_record of serialized tf.train.Example, as `tfds build --file_format=array_record` writes;
    shard lengths from the folder's `dataset_info.json`, class names from its `label.labels.txt`),
    `files` (an image folder), `table` (a CSV/TSV/parquet list of image paths),
    `rows` (a Hugging Face dataset's rows: `image` names the image column, `caption` the text column)."""
    image: str | None = "jpg"
    """Key (or member extension, or column) holding the encoded image."""
    caption: str | None = "txt"
    """Key holding the caption text; null for an image-only entry (its batches have no ``caption``)."""
    label: str | None = None
    """Key holding an integer class label."""
    key: str | None = None
    """Key holding the sample's id; tar samples use their member prefix when unset."""
    embedding: str | None = None
    """Key holding a precomputed embedding (`.npy` member)."""


class Captions(_Frozen):
    """How a record without text of its own gets a caption."""

    class_names: str | None = None
    """A file of class names, one per line, relative to the catalog file or a URL
    (a `tf_example` entry without one reads `label.labels.txt` beside its shards)."""
    templates: tuple[str, ...] = ()
    """Prompt templates with one `{}` for the class name; one is drawn per record."""


class Loading(_Frozen):
    """How the dataset is loaded unless a call says otherwise."""

    image_size: PositiveInt = 128
    augmentation: Augmentation = "flip_jitter"
    resize: ResizeMode = "center_crop"
    val_batches: NonNegativeInt | None = 4
    """Batches held out of the head of the source for validation (0 or null holds nothing out)."""
    val_split: str | None = None
    """A named split to validate on instead of a holdout; it must be under `splits`."""
    count: PositiveInt | None = None
    """Take only this many records from the head of the source."""
    on_bad_sample: BadSamplePolicy = "raise"
    bad_sample_budget: Annotated[float, Field(ge=0.0, le=1.0)] = 0.001
    """With `skip`: the fraction of records that may be dropped before loading stops."""
    captions: Captions = Captions()
    max_pixels: PositiveInt = 40_000_000
    """Images with more pixels are refused from their header, before decoding (one 81 Mpx PNG costs 1 GB)."""
    read_ahead: ByteSize = ByteSize(8 * 2**20)
    """Bytes a remote stream (tar indexing, gzip tars) reads per request; accepts `8 MiB`."""


class Component(_Frozen):
    """One dataset in a mixture."""

    name: str
    """Another entry's name or alias."""
    weight: Annotated[float, Field(gt=0)] | None = None
    """Sampling weight, normalised over the components; unset means proportional to its declared samples."""


class Mixture(_Frozen):
    """Datasets sampled together, each record drawn from a component chosen by weight."""

    components: Annotated[tuple[Component, ...], Field(min_length=1)]
    exhaustion: Exhaustion = "stop_on_all"
    """`stop_on_all`: a spent component drops out and the rest are renormalised (each record once an epoch);
    `stop_on_first`: the epoch ends when any component is spent; `restart`: spent components start over."""


class Embeddings(_Frozen):
    """A folder of `.npy` embedding files aligned with an image entry shard by shard (DALLE2-pytorch)."""

    images: str | None = None
    """The entry whose tar shards these embeddings align with."""
    prefix: str = "img_emb_"
    """File prefix: shard 3 is `img_emb_0003.npy` with shard_width 4."""
    shard_width: PositiveInt = 4
    """Digits of the shard number, both in file names and at the front of a record key."""
    index_width: PositiveInt | None = None
    """Digits after the shard number in a record key; that number is the row in the `.npy`."""
    dim: PositiveInt
    dtype: Literal["float16", "float32", "float64"] = "float32"


class Prior(_Frozen):
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


class Entry(_Frozen):
    """One dataset of the catalog, keyed by its name in the YAML file."""

    description: str
    aliases: tuple[str, ...] = ()
    """Other names `datacat` finds this entry by; lookup ignores case."""
    homepage: str | None = None
    license: str | None = None
    citation: str | None = None
    notes: str | None = None
    """Facts a user should know that have no field: provenance, a reading of the reference chosen."""
    format: str
    """A key of the format registry: webdataset, array_record, image_folder, image_list, huggingface, embeddings,
    embedding_table, mixture."""
    location: Location | None = None
    splits: dict[str, Location] = {}
    """Other splits by name (e.g. `validation`), each a location of its own."""
    totals: Totals = Totals()
    record: Record = Record()
    loading: Loading = Loading()
    mixture: Mixture | None = None
    embeddings: Embeddings | None = None
    prior: Prior | None = None
    """For format `embedding_table`: the embedding tables' layout and split."""
