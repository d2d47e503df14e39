"""The format registry: each ``format:`` value's declaration, built in, registered, or from a package's entry point.

Like fsspec's ``known_implementations``: a name maps to where its code lives,
and the module is imported on first use only, so ``import datacat`` costs
none of the readers or frameworks. A format is one module ending in a
:class:`Format` declaration (its reader, its layouts, its own YAML section
and that section's options model, the batch keys it adds, how ``verify``
counts a shard, its documentation); the schema, resolution, collation, the
backends and ``verify`` read the declaration and never name a format.

datacat's own formats live under ``datacat/formats/`` (:data:`FORMATS`);
another package adds one with :func:`register_format`, or without any call
through an entry point in the ``datacat.formats`` group::

    [project.entry-points."datacat.formats"]
    jsonl = "my_package.jsonl_format:FORMAT"

A mixture is not a format: it is a composite of other entries' sources
(:mod:`datacat.loading.mixture`), declared by an entry's ``mixture`` section.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel

from datacat.errors import BackendUnavailable, OptionError

if TYPE_CHECKING:
    import numpy as np

    from datacat.plan import Plan, ShardFacts

__all__ = [
    "BACKENDS",
    "ENTRY_POINTS",
    "FORMATS",
    "MIXTURE",
    "BatchFill",
    "Filled",
    "Format",
    "Implementation",
    "RandomAccessReader",
    "RawItem",
    "Reader",
    "StreamReader",
    "format_names",
    "format_of",
    "load_implementation",
    "register_format",
]

ENTRY_POINTS = "datacat.formats"
"""The entry-point group a package declares its formats in: ``name = "module:attribute"`` naming a Format."""

MIXTURE = "mixture"
"""The ``format:`` of an entry that mixes others: not a registered format but a composite source."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """Where a backend lives (``"module:attribute"``), and how to install what it needs."""

    target: str
    hint: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class RawItem:
    """One record as read, before parsing: where it came from and its bytes or members.

    Bytes may be a ``memoryview`` of what was read (a record or member is
    not copied out of its span); ``bytes(payload)`` makes a copy.
    """

    key: str
    shard: str
    uid: int
    payload: Any


class RandomAccessReader(Protocol):
    """Raw records by global index: shards in plan order, records in shard order.

    - Built from a :class:`~datacat.plan.Plan` alone and picklable, so
      worker processes get copies; what it opens is opened again in each.
    - ``len(reader)`` and ``counts`` (records per shard) are known once it is
      built; ``items(indices)`` gives the same bytes for the same index in any
      process, in the order asked, reading a batch's records at once.
    - A record that cannot be read is its ``RecordError`` (a ``ValueError``,
      judged by the bad-sample policy) or storage error in its place in the
      list; a shard that cannot be opened (or holds another count than the
      entry declares) raises a ``ShardError`` or ``FileNotFoundError`` naming it.
    - ``parse(item)`` turns a raw item into the record dict of
      :mod:`datacat.transforms.sample` and raises ``ValueError`` for a
      record that cannot be read.
    """

    @property
    def random_access(self) -> Literal[True]: ...

    @property
    def counts(self) -> Sequence[int]: ...

    def __len__(self) -> int: ...

    def items(self, indices: Sequence[int]) -> list[RawItem | Exception]: ...

    def parse(self, item: RawItem) -> dict[str, Any]: ...


class StreamReader(Protocol):
    """Raw records shard by shard, front to back (gzip tars, embedding folders beside tars).

    - Built from a Plan alone and picklable, as a random-access reader.
    - ``iter_shard(i)`` yields shard ``i``'s records in the same order every
      time; a shard that cannot be opened raises a ``ShardError`` (or
      ``FileNotFoundError``) naming it, a record that cannot be split out
      a ``RecordError``. ``counts`` are the records per shard when known
      without reading (a manifest), else empty: the loader then needs the
      entry's ``per_shard``.
    - ``parse(item)`` as for a random-access reader.
    """

    @property
    def random_access(self) -> Literal[False]: ...

    @property
    def counts(self) -> Sequence[int]: ...

    def iter_shard(self, shard: int) -> Iterator[RawItem]: ...

    def parse(self, item: RawItem) -> dict[str, Any]: ...


Reader = RandomAccessReader | StreamReader
"""What a format's reader is: ``reader.random_access`` tells which."""


@dataclasses.dataclass
class Filled:
    """What :meth:`BatchFill.fill` read besides the arrays it wrote: each record's other fields, and what it left.

    ``fields`` holds one sequence per key (``key``, and ``caption`` or ``label``
    when the records have them), a value per record of the batch. ``left``
    maps a record's slot to why it was not filled: its error (a bad record,
    judged by the bad-sample policy as if it had been read one by one), or
    None to read that record the ordinary way (its fields' values then are
    placeholders that are not used).
    """

    fields: dict[str, Sequence[Any]]
    left: dict[int, Exception | None] = dataclasses.field(default_factory=dict)


class BatchFill(Protocol):
    """A batch's fixed-size arrays read straight into the batch's buffers: no record decoded, nothing copied twice.

    Made by a format's ``fill`` for a plan whose records allow it (pre-resized
    pixels of the loader's image size, embedding rows, in local files);
    picklable, as a reader is. ``arrays`` gives each key it fills: the shape
    of one record's array and its dtype. ``fill(positions, out)`` writes the
    records at canonical ``positions`` (int64) into row ``i`` of each ``out[key]``
    and returns their other fields (:class:`Filled`); it never raises for a
    record, only for a shard that cannot be read.
    """

    @property
    def arrays(self) -> Mapping[str, tuple[tuple[int, ...], str]]: ...

    def threads(self, run: int) -> int:
        """Threads of one process that fill batches side by side, for batches of runs of ``run`` neighbouring
        records (1: each record on its own; 0: not shuffled, the batch one run): 2 where the copies let the GIL
        go and a second thread adds to the first, 1 where it would only contend with it. The loader starts no
        worker processes for a filled batch either way (they would only copy it once more)."""
        ...

    def fill(self, positions: np.ndarray, out: Mapping[str, np.ndarray]) -> Filled: ...


def _any_name(shard: str) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Format:
    """One ``format:`` value: what its catalog entries declare and how its records are read.

    ``access`` is ``"random"`` for formats read by index (array_record, image
    lists), ``"indexed"`` for tar shards (read by index through a byte index
    of their members, built on first read or by ``datacat verify``; a gzip tar
    is read front to back) and ``"stream"`` for formats read front to back.
    ``layouts`` are the ``record.layout`` values it reads, the first being
    the default. ``contract(plan)`` is what ``datacat describe`` prints: the
    rules the files follow, one sentence each.

    ``section`` names the format's own YAML section and ``options`` the
    pydantic model it is validated with (its errors carry the file and
    line); the validated model is the Plan's ``options``. ``needs`` names the
    entry sections the format cannot do without (``location``, the schema's
    ``embeddings``; its own section is needed when its model has a required
    field) and ``sections`` the schema's sections only it may have.

    ``arrays`` are the batch keys, besides ``image`` and ``label``, that hold
    one array per sample, stacked into the batch's array (each backend's
    tensor); ``rows`` marks a format whose records have no image (each
    sample is its key, its caption if the record has one, and ``arrays``).
    ``shard_facts(plan, sizes)`` is how ``datacat verify`` counts the plan's
    shards: given the shards found and their listed sizes by name, a
    function of a shard's index to its facts (None: verify does not check
    this format).
    ``names_a_shard`` tells a shard name of this format from a mistake;
    ``shards_are`` says what one is. ``counted`` says how ``datacat count``
    counts: per shard, or when the entry is opened. ``val_batches`` False:
    the format declares its own validation split, and the holdout of
    ``loading.val_batches`` does not apply; ``own_validation(options)`` tells
    whether an entry declares its validation split inside its train shards
    (the reader keeps that split's records). ``used_here`` is set for a
    format whose native library a forked child cannot use once its parent
    has: it tells whether this process has loaded it (worker processes then
    start from a forkserver). ``fill(reader, plan)`` is the format's batch
    path (:class:`BatchFill`): for a plan whose records it can read straight
    into a batch's buffers, else None (records are then read one by one).
    ``fields`` says whether its readers pass ``record.fields`` through, and
    ``metadata`` names the ``record.metadata`` tables they join.
    ``doc`` is the format's page in the reference.
    """

    reader: Callable[[Plan], Reader]
    access: Literal["random", "indexed", "stream"]
    layouts: tuple[str, ...]
    contract: Callable[[Plan], list[str]]
    needs: tuple[str, ...] = ("location",)
    sections: tuple[str, ...] = ()
    section: str | None = None
    options: type[BaseModel] | None = None
    arrays: tuple[str, ...] = ()
    rows: bool = False
    shard_facts: Callable[[Plan, Mapping[str, int]], Callable[[int], ShardFacts]] | None = None
    names_a_shard: Callable[[str], bool] = _any_name
    shards_are: str = ""
    counted: Literal["per_shard", "at_open"] = "per_shard"
    val_batches: bool = True
    own_validation: Callable[[BaseModel], bool] | None = None
    used_here: Callable[[], bool] | None = None
    fill: Callable[[Reader, Plan], BatchFill | None] | None = None
    hint: str = ""
    fields: bool = False
    metadata: tuple[str, ...] = ()
    doc: str = ""

    def __post_init__(self) -> None:
        if (self.section is None) != (self.options is None):
            raise OptionError("a format declares its section and the options model that validates it together")


FORMATS: dict[str, str] = {
    "webdataset": "datacat.formats.webdataset",
    "array_record": "datacat.formats.array_record",
    "image_folder": "datacat.formats.image_folder",
    "image_list": "datacat.formats.image_list",
    "huggingface": "datacat.formats.huggingface",
    "embeddings": "datacat.formats.embeddings",
    "embedding_table": "datacat.formats.embedding_table",
}
"""datacat's own formats: each ``format:`` value and the module whose ``FORMAT`` declares it."""

_REGISTERED: dict[str, Format] = {}
_LOADED: dict[str, Format] = {}


def register_format(name: str, declaration: Format) -> None:
    """Adds format ``name``: entries with ``format: name`` are read by ``declaration`` in this process.

    A format that worker processes must know too (they are started by
    forkserver or spawn) is better declared by an entry point, which every
    process finds. Raises OptionError for a name datacat's own formats or
    the mixture already use.
    """
    if name in FORMATS or name == MIXTURE:
        raise OptionError(f"format {name!r} is datacat's own; register yours under another name")
    if not isinstance(declaration, Format):
        raise OptionError(f"format {name!r}: register a datacat.registry.Format, not {type(declaration).__name__}")
    _REGISTERED[name] = declaration
    _LOADED.pop(name, None)


@functools.cache
def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    # Installed packages' formats, read once a process: scanning every distribution's metadata took ~12 ms
    # an entry, a catalog's check asks for each.
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS) if ep.name not in FORMATS}


def format_names() -> list[str]:
    """Every format known here, sorted: datacat's own, registered ones, and those of installed packages."""
    return sorted({*FORMATS, *_REGISTERED, *_entry_points()})


def format_of(name: str) -> Format:
    """The declaration of format ``name``, its module imported now; an unknown name is an OptionError."""
    found = _LOADED.get(name) or _REGISTERED.get(name)
    if found is not None:
        return found
    if name in FORMATS:
        found = importlib.import_module(FORMATS[name]).FORMAT
    elif (point := _entry_points().get(name)) is not None:
        found = point.load()
        if not isinstance(found, Format):
            raise OptionError(
                f"the entry point {point.value!r} of format {name!r} ({ENTRY_POINTS}) is a "
                f"{type(found).__name__}, not a datacat.registry.Format"
            )
    else:
        raise OptionError(f"{name!r} is not a known format (known: {', '.join(format_names())})")
    _LOADED[name] = found
    return found


BACKENDS: dict[str, Implementation] = {
    "torch": Implementation(
        "datacat.backends.torch:open_torch", "The torch backend needs torch: pip install 'datacat[torch]'"
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
