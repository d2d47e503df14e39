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

from pydantic import BaseModel, ByteSize, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "BATCH_KEYS",
    "Augmentation",
    "BadSamplePolicy",
    "Buckets",
    "Captions",
    "Component",
    "Condition",
    "Embeddings",
    "Entry",
    "Exhaustion",
    "Loading",
    "Location",
    "Mixture",
    "Record",
    "ResizeMode",
    "Section",
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


class Section(_Frozen):
    """The base of a format's own YAML section (its ``options`` model): frozen, unknown keys refused.

    Each field's docstring is its line in the catalog reference.
    """


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


BATCH_KEYS = (
    *("image", "caption", "label", "key", "embedding", "tokens", "component"),
    *("original_size", "crop_top_left", "target_size"),
)
"""The batch keys datacat fills itself; ``record.fields`` may not reuse them."""


class Record(_Frozen):
    """How one record is laid out: which key holds what."""

    layout: str | None = None
    """One of the layouts the entry's format declares (a wrong one is an error listing them); unset means its
    first. Each format's page in the reference says what its layouts are."""
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
    fields: tuple[str, ...] = ()
    """Further keys passed through to every batch under their own names: tar members by extension (`json` parsed
    to a dict), packed record keys (decoded by their name as members are), or columns of the shard's `metadata`
    table. Numbers and same-shaped arrays are stacked into one array a batch, the rest kept as lists."""
    metadata: Literal["parquet"] | None = None
    """A table beside each tar shard joined to its samples by key: `parquet` reads img2dataset's `NNNNN.parquet`
    (the shard's name with `.parquet`) and matches its `key` column; `fields` then may name its columns
    (`aesthetic`, `punsafe`, `width`, ...)."""

    @field_validator("fields")
    @classmethod
    def _fields_are_free(cls, fields: tuple[str, ...]) -> tuple[str, ...]:
        taken = sorted(set(fields) & set(BATCH_KEYS))
        if taken:
            raise ValueError(
                f"{', '.join(map(repr, taken))}: datacat fills that batch key itself (it fills {', '.join(BATCH_KEYS)}); "
                "set record.image / caption / label / key / embedding to choose those keys instead"
            )
        if len(set(fields)) != len(fields):
            raise ValueError("a field is named twice")
        return fields


Scalar = float | int | str | bool


class Condition(_Frozen):
    """Bounds on one metadata column (`select: {aesthetic: {">=": 6}}`); a record is kept when its value meets
    every bound given. A null meets none."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    ge: Scalar | None = Field(None, alias=">=")
    gt: Scalar | None = Field(None, alias=">")
    le: Scalar | None = Field(None, alias="<=")
    lt: Scalar | None = Field(None, alias="<")
    eq: Scalar | None = Field(None, alias="==")
    ne: Scalar | None = Field(None, alias="!=")
    in_: tuple[Scalar, ...] | None = Field(None, alias="in")

    @model_validator(mode="after")
    def _says_something(self) -> Condition:
        if all(value is None for value in self.bounds().values()):
            raise ValueError('give at least one of ">=", ">", "<=", "<", "==", "!=", "in"')
        return self

    def bounds(self) -> dict[str, Any]:
        """The bounds given, by operator name (``ge``, ``in_``, ...)."""
        return {name: getattr(self, name) for name in type(self).model_fields if getattr(self, name) is not None}


class Captions(_Frozen):
    """How a record without text of its own gets a caption."""

    class_names: str | None = None
    """A file of class names, one per line, relative to the catalog file or a URL
    (a `tf_example` entry without one reads `label.labels.txt` beside its shards)."""
    templates: tuple[str, ...] = ()
    """Prompt templates with one `{}` for the class name; one is drawn per record."""


class Buckets(_Frozen):
    """Aspect-ratio buckets: each record goes to the bucket nearest its aspect ratio (from its metadata's `width`
    and `height`, no decode), every batch comes from one bucket and is resized to its size."""

    sizes: tuple[tuple[PositiveInt, PositiveInt], ...] = ()
    """The buckets' (height, width), e.g. `[[1024, 1024], [896, 1152], [1152, 896]]`."""
    area: PositiveInt | None = None
    """Instead of `sizes`: the side of a square of the buckets' area (1024: about 1024 x 1024 pixels each)."""
    step: PositiveInt = 64
    """With `area`: each side a multiple of this."""
    max_ratio: Annotated[float, Field(ge=1.0)] = 2.0
    """With `area`: the largest long side over short side."""

    @model_validator(mode="after")
    def _one_way(self) -> Buckets:
        if bool(self.sizes) == (self.area is not None):
            raise ValueError("give either sizes (a list of [height, width]) or area (with step and max_ratio)")
        if self.area is not None and self.area < self.step:
            raise ValueError(f"area {self.area} is below one step of {self.step}")
        return self

    def resolved(self) -> tuple[tuple[int, int], ...]:
        """The (height, width) of every bucket: ``sizes``, or those ``area``, ``step`` and ``max_ratio`` make."""
        if self.sizes:
            return tuple(dict.fromkeys(self.sizes))
        assert self.area is not None
        target, step, found = self.area * self.area, self.step, set()
        for width in range(step, int(self.area * self.max_ratio**0.5) + step, step):
            height = max(step, round(target / width / step) * step)
            if max(height / width, width / height) <= self.max_ratio:
                found.add((height, width))
                found.add((width, height))
        return tuple(sorted(found, key=lambda size: size[1] / size[0]))


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
    buckets: Buckets | None = None
    """Batches by aspect ratio instead of squares of `image_size` (needs `record.metadata` for each image's size)."""
    size_conditioning: bool = False
    """Each batch carries, per image, `original_size` (h, w of the stored image), `crop_top_left` (y, x of the
    crop in those pixels, in the flipped image when the sample was flipped) and `target_size` (h, w), as SDXL's
    micro-conditioning wants them: int64 arrays [batch, 2]."""


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


class Entry(_Frozen):
    """One dataset of the catalog, keyed by its name in the YAML file.

    Besides the keys below, an entry may have its format's own section (e.g.
    `prior` for `embedding_table`), validated by the model the format
    declares (:class:`datacat.registry.Format`); any other key is refused.
    """

    model_config = ConfigDict(frozen=True, extra="allow", use_attribute_docstrings=True)

    description: str
    aliases: tuple[str, ...] = ()
    """Other names `datacat` finds this entry by; lookup ignores case."""
    homepage: str | None = None
    license: str | None = None
    citation: str | None = None
    notes: str | None = None
    """Facts a user should know that have no field: provenance, a reading of the reference chosen."""
    format: str
    """A format of the registry (the reference's formats page lists them), or `mixture` for an entry that mixes
    others."""
    location: Location | None = None
    splits: dict[str, Location] = {}
    """Other splits by name (e.g. `validation`), each a location of its own."""
    totals: Totals = Totals()
    record: Record = Record()
    select: dict[str, Condition] = {}
    """Only the records whose metadata meet these bounds, by column of the `record.metadata` table, e.g.
    `{aesthetic: {">=": 6}, punsafe: {"<": 0.1}, width: {">=": 512}}`; no shard is rewritten."""
    loading: Loading = Loading()
    mixture: Mixture | None = None
    embeddings: Embeddings | None = None

    def section(self, name: str) -> Any:
        """The raw value of the format's own section ``name`` (None when the entry has none)."""
        return (self.model_extra or {}).get(name)
