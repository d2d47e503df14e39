"""Loader options: one frozen value, validated once where a loader is opened, passed whole to what reads it.

``LoadOptions`` says how a Plan is read (batch size, epochs, shuffle,
workers, this rank's place, the bad-sample policy, the tokenizer); the
sources, the epoch loop and both backends take it as one value instead of a
keyword each. ``TorchOptions`` and ``JaxOptions`` hold what only one
framework understands. None of them imports a framework.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from datacat.errors import OptionError
from datacat.schema import BadSamplePolicy
from datacat.storage.shard_cache import ShardCache

if TYPE_CHECKING:
    import jax

    from datacat.transforms.captions import Tokenize

__all__ = ["ImageLayout", "JaxOptions", "LoadOptions", "TorchOptions"]

ImageLayout = Literal["hwc_uint8", "chw_float"]
"""How torch batches hold images: uint8 [B, H, W, 3], or float [B, 3, H, W] in [-1, 1]."""


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """How one rank reads a Plan: batches, epochs, order, workers and the bad-sample policy.

    ``rank`` and ``world_size`` left None are filled in by the backend (from
    torch.distributed or jax's process index); ``on_bad_sample`` and
    ``bad_sample_budget`` left None are the entry's own. ``tokenize`` is
    called on each caption in the workers; its result is the batch's
    ``tokens``. ``shard_cache`` keeps remote shards on a local disk
    (:class:`~datacat.storage.shard_cache.ShardCache`).
    """

    batch_size: int
    epochs: int | None = 1
    shuffle: bool = True
    shuffle_run: int = 1
    """Neighbouring records the shuffle moves together (random-access formats, unbucketed): 1, each on its own;
    e.g. 64, a batch is a few contiguous stretches of each shard, read at near memory speed
    (:class:`~datacat.loading.shuffle.RunShuffle`)."""
    num_workers: int = 0
    drop_remainder: bool = False
    rank: int | None = None
    world_size: int | None = None
    on_bad_sample: BadSamplePolicy | None = None
    bad_sample_budget: float | None = None
    tokenize: Tokenize | None = None
    shard_cache: ShardCache | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise OptionError(f"batch_size must be at least 1, not {self.batch_size}")
        if self.shuffle_run < 1:
            raise OptionError(f"shuffle_run is a count of neighbouring records, at least 1, not {self.shuffle_run}")
        if self.num_workers < 0:
            raise OptionError(f"num_workers must be 0 or more, not {self.num_workers}")
        if self.epochs is not None and self.epochs < 1:
            raise OptionError(f"epochs must be at least 1 (or None for endless), not {self.epochs}")
        if self.on_bad_sample not in (None, "raise", "skip"):
            raise OptionError(f"on_bad_sample must be 'raise' or 'skip', not {self.on_bad_sample!r}")
        if self.bad_sample_budget is not None and not 0.0 <= self.bad_sample_budget <= 1.0:
            raise OptionError(f"bad_sample_budget is a fraction of the records, 0 to 1, not {self.bad_sample_budget}")
        if self.world_size is not None and self.rank is not None and not 0 <= self.rank < self.world_size:
            raise OptionError(f"rank {self.rank} is outside a world of {self.world_size}")

    def placed(self, rank: int, world_size: int) -> LoadOptions:
        """These options with ``rank`` and ``world_size`` filled in where they were left None."""
        return dataclasses.replace(
            self,
            rank=rank if self.rank is None else self.rank,
            world_size=world_size if self.world_size is None else self.world_size,
        )

    @property
    def order(self) -> int:
        """The epoch's order as the views take it: 0 in the stored order, else the shuffle's run (1: each record)."""
        return self.shuffle_run if self.shuffle else 0

    @property
    def place(self) -> tuple[int, int]:
        """(rank, world size), 0 of 1 where the backend has not filled them in."""
        return (0 if self.rank is None else self.rank), (1 if self.world_size is None else self.world_size)


@dataclasses.dataclass(frozen=True)
class TorchOptions:
    """What only the torch backend understands: image layout, prefetching, the workers' start method and timeout."""

    image_layout: ImageLayout = "hwc_uint8"
    prefetch_factor: int = 4
    multiprocessing_context: str | None = None
    """``fork``, ``forkserver`` or ``spawn``; None: fork unless forking is known to break the workers."""
    worker_timeout: float = 600.0
    """Seconds to wait for a worker's batch before calling the worker stuck."""
    reuse_batch_memory: bool = True
    """Workers resize images into shared memory that is filled again, instead of a new tensor each batch."""

    def __post_init__(self) -> None:
        if self.image_layout not in ("hwc_uint8", "chw_float"):
            raise OptionError(f"image_layout must be 'hwc_uint8' or 'chw_float', not {self.image_layout!r}")


@dataclasses.dataclass(frozen=True)
class JaxOptions:
    """What only the jax backend understands: device placement and grain's reader threads."""

    device_put: bool = False
    """Batches as global ``jax.Array`` s (implied by ``sharding``): under ``jax.distributed``, of the global batch
    over every process's devices, each process's records on the devices it addresses."""
    sharding: jax.sharding.Sharding | None = None
    """How batches are laid out; None with ``device_put``: split along ``data`` over ``jax.devices()``, process by
    process."""
    read_threads: int = 1
    """grain reader threads in each process."""

    def __post_init__(self) -> None:
        if self.read_threads < 1:
            raise OptionError(f"read_threads must be at least 1, not {self.read_threads}")
