"""The jax backend: an EpochView as a grain ``MapDataset`` source, prefetched in grain worker processes.

The source is ``grain.MapDataset.source(batches)``, one element per batch
of this process's slice of the epoch (the view already holds the epoch's
global shuffle from the seed); the shared transform and collation run
inside ``batches[b]`` in the workers, and ``mp_prefetch`` spreads the
batches over processes: interleaved for random access formats (the same
order for any worker count), consecutive runs for tar shards so each worker
reads its shards front to back. Resuming uses grain's iterator
``get_state``/``set_state``.

Batches are dicts of numpy arrays, or with ``device_put=True`` global
``jax.Array`` s laid out over the local devices (the VQGAN example's
"superbatch", done by ``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# This module is the jax backend; nothing else in datacat imports jax or grain.
import grain
import jax
import numpy as np

from datacat.backends.base import Loader
from datacat.errors import OptionError
from datacat.pipeline import BatchView
from datacat.resolve import Plan

__all__ = ["JaxLoader", "open_jax"]


def _mark_flags_parsed() -> None:
    # grain's worker processes crash on unparsed absl flags (grain issue #1355, unfixed in 0.2.18).
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class JaxLoader(Loader):
    """Batches as dicts of numpy arrays (or ``jax.Array`` with ``device_put=True``)."""

    framework = "jax"

    def __init__(
        self, plan: Plan, *, device_put: bool = False, sharding: Any = None, read_threads: int = 1, **options: Any
    ) -> None:
        super().__init__(plan, **options)
        self.read_threads = read_threads
        self.device_put = device_put or sharding is not None
        self.sharding = sharding
        self._iterator: Any = None
        if self.device_put:
            devices = jax.local_device_count()
            if self.sharding is None:
                mesh = jax.sharding.Mesh(np.array(jax.local_devices()), ("data",))
                self.sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))  # type: ignore[no-untyped-call]
            if any(size % devices for size in self.schedule.batch_sizes):
                raise OptionError(
                    f"{plan.name}: jax arrays split over {devices} local device(s) need every batch size divisible by it; "
                    f"this schedule has batches of {sorted(set(self.schedule.batch_sizes))}. Pass drop_remainder=True "
                    "and a batch_size divisible by the device count"
                )

    def _batches(self, batches: BatchView, first: int) -> Iterator[dict[str, Any]]:
        # One reader thread per process: a batch is already a unit of work, and more
        # threads would only contend for the two cores with the worker processes.
        dataset = grain.MapDataset.source(batches).to_iter_dataset(grain.ReadOptions(num_threads=self.read_threads))
        if self.num_workers > 0:
            _mark_flags_parsed()
            dataset = dataset.mp_prefetch(
                grain.multiprocessing.MultiprocessingOptions(num_workers=self.num_workers),
                sequential_slice=not self.source.random_access,
            )
        iterator = iter(dataset)
        saved = (self._restored or {}).get("grain")
        if first and saved is not None:
            iterator.set_state(saved)
        elif first:
            for _ in range(first):  # no grain state to restore (another worker count): read past
                next(iterator)
        self._iterator = iterator
        return iterator  # type: ignore[no-any-return]

    def _backend_state(self) -> dict[str, Any]:
        if self._iterator is None or self.batch == 0:
            return {}
        return {"grain": self._iterator.get_state()}

    def _finish(self, batch: dict[str, Any]) -> dict[str, Any]:
        for key, value in batch.items():
            # grain hands arrays over in shared memory; give the user plain arrays and free the segments.
            if isinstance(value, np.ndarray) and type(value) is not np.ndarray:
                batch[key] = np.array(value)
                if hasattr(value, "unlink_on_del"):
                    value.unlink_on_del()
        if self.device_put:
            for key in ("image", "label", "embedding"):
                if key in batch:
                    batch[key] = jax.make_array_from_process_local_data(self.sharding, batch[key])  # type: ignore[no-untyped-call]
        return batch


def open_jax(plan: Plan, **options: Any) -> JaxLoader:
    """A JaxLoader for ``plan``; rank and world size default to jax's process index and count."""
    if options.get("rank") is None:
        options["rank"] = jax.process_index()
    if options.get("world_size") is None:
        options["world_size"] = jax.process_count()
    return JaxLoader(plan, **options)
