"""Backends: a Plan run by torch or by jax/grain, imported on first use only.

``open`` resolves a catalog name (or takes a Plan), picks the framework
(``auto``: see :func:`choose_framework`) and builds its loader. This module
imports neither framework itself.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from datacat.catalog import Catalog
from datacat.errors import BackendUnavailable, OptionError
from datacat.registry import BACKENDS, load_implementation
from datacat.resolve import Plan, resolve
from datacat.schema import Loading

__all__ = ["choose_framework", "open_loader"]

_LOADING_OPTIONS = ("image_size", "augmentation", "resize", "val_batches", "val_split", "count", "captions")


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
    split: str = "train",
    seed: int = 0,
    root: str | None = None,
    catalog: Catalog | None = None,
    **options: Any,
) -> Any:
    """A loader of batches for a catalog entry or a Plan, in ``framework``."""
    if framework == "auto":
        framework = choose_framework()
    if framework not in BACKENDS:
        raise OptionError(f"unknown framework {framework!r}; use one of {', '.join([*BACKENDS, 'auto'])}")
    loading = {k: options.pop(k) for k in list(options) if k in _LOADING_OPTIONS and options[k] is not None}
    for key in _LOADING_OPTIONS:
        options.pop(key, None)
    if isinstance(name_or_plan, Plan):
        plan = name_or_plan
        merged = Loading.model_validate({**plan.loading.model_dump(), **loading})
        plan = plan.model_copy(update={"batch_size": batch_size, "loading": merged})
    else:
        plan = resolve(
            name_or_plan, split=split, root=root, seed=seed, batch_size=batch_size, catalog=catalog, **loading
        )
    opener = load_implementation(BACKENDS[framework])
    return opener(plan, batch_size=batch_size, **options)
