"""Backends: a Plan run by torch or by jax/grain, imported on first use only.

``open`` resolves a catalog name (or takes a Plan), picks the framework
(``auto``: see :func:`choose_framework`) and builds its loader. This module
imports neither framework itself.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from datacat.catalog import Catalog
from datacat.errors import BackendUnavailable, OptionError
from datacat.loading.contracts import Loader
from datacat.loading.options import ImageLayout, JaxOptions, LoadOptions, TorchOptions
from datacat.plan import Plan
from datacat.planning import resolve
from datacat.registry import BACKENDS, load_implementation
from datacat.resolve import override_loading
from datacat.schema import Augmentation, BadSamplePolicy, ResizeMode
from datacat.storage.shard_cache import ShardCache

if TYPE_CHECKING:  # the transforms need numpy, which the core install does not have
    import jax

    from datacat.transforms.captions import Tokenize

__all__ = ["choose_framework", "open_loader"]


def _installed(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def choose_framework() -> str:
    """The framework ``auto`` means here.

    jax when jax (with grain) is installed and sees an accelerator; else
    torch when it sees CUDA; else whichever is installed, torch first; else
    ``BackendUnavailable`` naming the extras.
    """
    has_jax, has_torch = _installed("jax", "grain"), _installed("torch")
    if has_jax:
        import jax  # only to ask which devices it sees

        if jax.default_backend() != "cpu":
            return "jax"
    if has_torch:  # with CUDA or without, torch comes before jax on the CPU
        return "torch"
    if has_jax:
        return "jax"
    raise BackendUnavailable("No framework is installed: pip install 'datacat[torch]' or 'datacat[jax]'")


def open_loader(
    name_or_plan: str | Plan,
    *,
    framework: str = "auto",
    batch_size: int,
    split: str | None = None,
    seed: int | None = None,
    epochs: int | None = 1,
    shuffle: bool = True,
    shuffle_run: int = 1,
    num_workers: int = 0,
    drop_remainder: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    on_bad_sample: BadSamplePolicy | None = None,
    bad_sample_budget: float | None = None,
    tokenize: Tokenize | None = None,
    shard_cache: ShardCache | None = None,
    root: str | None = None,
    catalog: Catalog | None = None,
    image_size: int | None = None,
    augmentation: Augmentation | None = None,
    resize: ResizeMode | None = None,
    val_batches: int | None = None,
    count: int | None = None,
    image_layout: ImageLayout | None = None,
    prefetch_factor: int | None = None,
    multiprocessing_context: str | None = None,
    worker_timeout: float | None = None,
    reuse_batch_memory: bool | None = None,
    device_put: bool | None = None,
    sharding: jax.sharding.Sharding | None = None,
    read_threads: int | None = None,
) -> Loader:
    """A loader of batches of a catalog entry (or a Plan) in torch or jax; iterate it for batches.

    Args:
        name_or_plan: An entry name or alias (any case), or a Plan from :func:`datacat.resolve`.
        framework: ``"torch"``, ``"jax"`` or ``"auto"`` (see :func:`choose_framework`).
        batch_size: Records per batch on this rank.
        split: ``"train"`` (default), ``"validation"`` (a named split, or the holdout), or another split of the entry.
        seed: Decides every shuffle and augmentation (default 0; with a Plan, its own seed).
        epochs: Passes over the data; None for endless.
        shuffle: Shuffle the records each epoch (stream formats: the shards' order).
        shuffle_run: Neighbouring records the shuffle moves together (1: each on its own; e.g. 64 reads an
            embedding table or pre-resized shards in contiguous stretches, near memory speed).
        num_workers: Worker processes decoding in parallel (0: in this process).
        drop_remainder: Only full batches; the tail that fills no batch on every rank is dropped.
        rank: This process's place; default from torch.distributed / RANK (torch) or jax's process index (jax).
        world_size: The number of ranks; default from torch.distributed / WORLD_SIZE (torch) or jax's process
            count (jax).
        on_bad_sample: Overrides the entry's bad-sample policy (``raise``, ``skip``).
        bad_sample_budget: Overrides the share of bad samples ``skip`` tolerates.
        tokenize: Called on each caption in the workers; its result is the batch's ``tokens``.
        shard_cache: A node-local folder and byte cap keeping remote shards after their first read
            (default: ``DATACAT_SHARD_CACHE`` and ``DATACAT_SHARD_CACHE_BYTES``, else none).
        image_size: Overrides the entry's ``loading.image_size``.
        augmentation: Overrides ``loading.augmentation``.
        resize: Overrides ``loading.resize``.
        val_batches: Overrides ``loading.val_batches``.
        count: Overrides ``loading.count``.
        image_layout: torch's own (see :class:`~datacat.loading.options.TorchOptions`), e.g. ``"chw_float"``.
        prefetch_factor: torch's own (TorchOptions).
        multiprocessing_context: torch's own (TorchOptions).
        worker_timeout: torch's own (TorchOptions).
        reuse_batch_memory: torch's own (TorchOptions).
        device_put: jax's own (see :class:`~datacat.loading.options.JaxOptions`).
        sharding: jax's own (JaxOptions).
        read_threads: jax's own (JaxOptions).

    Example:
        >>> loader = datacat.open("sample", framework="torch", batch_size=16, num_workers=2)
        >>> batch = next(iter(loader))
        >>> batch["image"].shape
        torch.Size([16, 64, 64, 3])
    """
    if framework == "auto":
        framework = choose_framework()
    if framework not in BACKENDS:
        raise OptionError(f"unknown framework {framework!r}; use one of {', '.join([*BACKENDS, 'auto'])}")
    options = LoadOptions(
        batch_size=batch_size,
        epochs=epochs,
        shuffle=shuffle,
        shuffle_run=shuffle_run,
        num_workers=num_workers,
        drop_remainder=drop_remainder,
        rank=rank,
        world_size=world_size,
        on_bad_sample=on_bad_sample,
        bad_sample_budget=bad_sample_budget,
        tokenize=tokenize,
        shard_cache=shard_cache if shard_cache is not None else ShardCache.from_env(),
    )
    torch_given: dict[str, Any] = {
        "image_layout": image_layout,
        "prefetch_factor": prefetch_factor,
        "multiprocessing_context": multiprocessing_context,
        "worker_timeout": worker_timeout,
        "reuse_batch_memory": reuse_batch_memory,
    }
    jax_given: dict[str, Any] = {"device_put": device_put, "sharding": sharding, "read_threads": read_threads}
    backend_options = _backend_options(framework, torch_given, jax_given)
    given: dict[str, Any] = {
        "image_size": image_size,
        "augmentation": augmentation,
        "resize": resize,
        "val_batches": val_batches,
        "count": count,
    }
    loading = {k: v for k, v in given.items() if v is not None}
    if isinstance(name_or_plan, Plan):
        given_for_resolve = [k for k, v in (("split", split), ("root", root), ("catalog", catalog)) if v is not None]
        if given_for_resolve:
            raise OptionError(
                f"{', '.join(given_for_resolve)} decide which Plan is built; {name_or_plan.name!r} is a Plan already. "
                f"Pass them to datacat.resolve, or pass the entry's name to datacat.open"
            )
        merged = override_loading(name_or_plan.name, name_or_plan.loading, loading)
        update: dict[str, Any] = {"batch_size": batch_size, "loading": merged}
        if seed is not None:
            update["seed"] = seed
        plan = name_or_plan.model_copy(update=update)
    else:
        plan = resolve(
            name_or_plan,
            split=split or "train",
            root=root,
            seed=0 if seed is None else seed,
            batch_size=batch_size,
            catalog=catalog,
            **loading,
        )
    opener = load_implementation(BACKENDS[framework])
    loader: Loader = opener(plan, options, backend_options)
    return loader


def _backend_options(
    framework: str, torch_given: dict[str, Any], jax_given: dict[str, Any]
) -> TorchOptions | JaxOptions:
    """The options of ``framework``'s backend from those given; another framework's option is an ``OptionError``."""
    mine, theirs = (torch_given, jax_given) if framework == "torch" else (jax_given, torch_given)
    foreign = sorted(k for k, v in theirs.items() if v is not None)
    if foreign:
        raise OptionError(
            f"{', '.join(foreign)}: not an option of the {framework} backend; drop it or pick its framework"
        )
    given = {k: v for k, v in mine.items() if v is not None}
    return TorchOptions(**given) if framework == "torch" else JaxOptions(**given)
