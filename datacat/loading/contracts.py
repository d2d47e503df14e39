"""The contracts of the loading layer: a source of samples, one epoch's records of it, and a loader of batches.

Stated as Protocols so that each side says what it relies on:
``SampleSource`` and ``MixtureSource`` are a :class:`Source`, their
``EpochView`` and ``MixtureView`` are :class:`Records`, and what
``datacat.open`` returns is a :class:`Loader`, whichever framework runs it.
Importing this module imports no numpy and no framework.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from typing import Self

    import numpy as np

    from datacat.loading.buckets import Bucketing
    from datacat.loading.epochs import Schedule
    from datacat.loading.sources import Fetched
    from datacat.plan import Plan
    from datacat.transforms.ledger import Ledger

__all__ = ["Batch", "Loader", "Records", "Source"]

Batch = dict[str, Any]
"""One batch: ``key`` and ``caption`` lists, arrays (numpy, torch or jax) for ``image``, ``label``, embeddings."""


class Records(Protocol):
    """One rank's records of one epoch, by index: what a worker process reads.

    Picklable (workers get copies) and safe to read from several threads.
    ``fetch`` never raises for data: a record that cannot be read comes back
    as its error, and ``finish`` turns each fetched record into a sample or a
    marker for the main process's ledger.
    """

    @property
    def source(self) -> Source: ...

    @property
    def schedule(self) -> Schedule: ...

    @property
    def epoch(self) -> int: ...

    @property
    def image_size(self) -> int: ...

    def image_shape(self, index: int) -> tuple[int, int]:
        """(height, width) of the images of the batch holding record ``index`` (a bucket's, else a square)."""
        ...

    @property
    def random_access(self) -> bool:
        """Whether records are read by position (else each shard front to back)."""
        ...

    @property
    def images(self) -> bool:
        """Whether samples have an ``image``."""
        ...

    def __len__(self) -> int: ...

    def fetch(self, indices: Sequence[int]) -> list[Fetched]:
        """The raw records at ``indices`` of this slice, or why each could not be read."""
        ...

    def finish(self, fetched: Sequence[Fetched], into: np.ndarray | None = None) -> list[dict[str, Any]]:
        """Samples (or markers) of fetched records; record ``i``'s image resized into ``into[i]`` when given."""
        ...


class Source(Protocol):
    """The samples of a Plan, cut into epochs: one ledger, and a view of any epoch for any rank.

    Deterministic: the same seed, epoch and schedule give the same records
    in every process. Picklable, so worker processes build views themselves.
    """

    @property
    def plan(self) -> Plan: ...

    @property
    def ledger(self) -> Ledger: ...

    @property
    def random_access(self) -> bool: ...

    @property
    def remote(self) -> bool:
        """Whether records come from remote storage (then reads are latency-bound and read ahead in threads)."""
        ...

    @property
    def bucketing(self) -> Bucketing | None:
        """The aspect-ratio buckets its epochs are cut by (None: batches of squares)."""
        ...

    def __len__(self) -> int: ...

    def epoch_length(self, seed: int, epoch: int) -> int:
        """Records in one epoch, all ranks together."""
        ...

    def view(self, schedule: Schedule, *, seed: int, epoch: int, shuffle: int) -> Records:
        """One rank's records of one epoch, by index."""
        ...


class Loader(Protocol):
    """Batches of one Plan for one rank, epoch after epoch, resumable: what ``datacat.open`` returns.

    Iterating gives the batches from where the loader is; ``len`` is the
    batches of an epoch on this rank (the same on every rank);
    ``state_dict()`` is a small JSON-able dict that ``load_state_dict``
    continues from; ``ledger`` counts the bad samples met. ``close()``
    stops its worker processes (also on leaving a ``with`` block).
    """

    framework: str
    """``"torch"`` or ``"jax"``."""

    @property
    def plan(self) -> Plan: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def schedule(self) -> Schedule:
        """This rank's part of the current epoch: its records and batch sizes."""
        ...

    @property
    def ledger(self) -> Ledger:
        """The bad-sample ledger (counts, skipped samples, ``summary()``)."""
        ...

    @property
    def retries(self) -> int:
        """Transient storage errors retried since the loader was opened, in its workers too."""
        ...

    def __iter__(self) -> Generator[Batch, None, None]:
        """The batches from where the loader is, to the last epoch; ``close()`` the generator to leave early."""
        ...

    def __len__(self) -> int: ...

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: epoch, batch, ledger, and what must match to resume."""
        ...

    def load_state_dict(self, state: dict[str, Any], *, allow_other_plan: bool = False) -> None:
        """Continues from ``state``; a state of another Plan or world layout is refused unless allowed."""
        ...

    def close(self) -> None:
        """Stops the worker processes; iterating again starts new ones."""
        ...

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc_info: object) -> None: ...
