"""Collation: a batch's samples as numpy arrays and lists, its images left in the rows they were resized into."""

from __future__ import annotations

from typing import Any

import numpy as np

from datacat.plan import Plan
from datacat.registry import MIXTURE, format_of

__all__ = ["SIZE_CONDITIONING", "array_keys", "collate_numpy", "field_keys", "stack_field"]


def array_keys(plan: Plan) -> tuple[str, ...]:
    """The batch keys of ``plan`` that hold one array per sample: ``image``, ``label``, its format's arrays, and the
    size conditioning when the entry asks for it.

    A mixture's are those of its components together (the size conditioning: when every component has it).
    """
    if plan.format == MIXTURE:
        found = [key for component in plan.components for key in array_keys(component.plan)]
        keys = tuple(dict.fromkeys(found))
        sized = all(component.plan.loading.size_conditioning for component in plan.components)
        return keys if sized else tuple(key for key in keys if key not in SIZE_CONDITIONING)
    return (
        "image",
        "label",
        *format_of(plan.format).arrays,
        *(SIZE_CONDITIONING if plan.loading.size_conditioning else ()),
    )


def field_keys(plan: Plan) -> tuple[str, ...]:
    """The ``record.fields`` batches of ``plan`` carry: a mixture's are those every component has."""
    if plan.format == MIXTURE:
        common = [set(field_keys(component.plan)) for component in plan.components]
        first = field_keys(plan.components[0].plan) if plan.components else ()
        return tuple(name for name in first if all(name in names for names in common))
    return plan.record.fields


SIZE_CONDITIONING = ("original_size", "crop_top_left", "target_size")
"""The batch keys of ``loading.size_conditioning``: int64 [batch, 2] each."""


def collate_numpy(
    samples: list[dict[str, Any]],
    images: np.ndarray | None,
    arrays: tuple[str, ...] = (),
    fields: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A batch of samples as numpy arrays (image, label, the format's ``arrays``) and lists (caption, key, tokens),
    with the record ``fields`` as :func:`stack_field` makes them.

    ``images`` is the batch array the samples' images were resized into, a
    row per fetched record (None for embedding-table rows, which have no
    image): the images stay where they are, the rows after a bad sample are
    moved up, and the batch's image is ``images[:n]``.
    """
    batch: dict[str, Any] = {"key": [s["key"] for s in samples]}
    if images is not None:
        for row, sample in enumerate(samples):
            pixels = sample["image"]
            # Rows do not overlap, so an image sharing memory with this row is the row (cheaper than .ctypes).
            if pixels.shape != images.shape[1:] or not np.may_share_memory(pixels, images[row]):
                images[row] = pixels  # a row after a bad sample, or an image made elsewhere (augmented)
        batch["image"] = images[: len(samples)]
    for name in arrays:
        if name not in ("image", "label") and samples and name in samples[0]:
            batch[name] = np.stack([s[name] for s in samples])
    if not samples or "caption" in samples[0]:  # image-only entries have none
        batch["caption"] = [s["caption"] for s in samples]
    if samples and "label" in samples[0]:
        batch["label"] = np.asarray([s["label"] for s in samples], dtype=np.int64)
    if samples and "tokens" in samples[0]:
        batch["tokens"] = [s["tokens"] for s in samples]
    if samples and "component" in samples[0]:
        batch["component"] = [s["component"] for s in samples]
    for name in fields:
        batch[name] = stack_field([s[name] for s in samples])
    return batch


def stack_field(values: list[Any]) -> np.ndarray | list[Any]:
    """A record field's values in one batch: numbers (bools, ints, floats) and same-shaped arrays as one array,
    anything else (text, dicts, None, mixed) as the list itself."""
    if values and all(isinstance(v, bool | np.bool_) for v in values):
        return np.asarray(values, dtype=np.bool_)
    if values and all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in values):
        return np.asarray(values, dtype=np.int64)
    if values and all(
        isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool) for v in values
    ):
        return np.asarray(values, dtype=np.float64)
    if values and all(isinstance(v, np.ndarray) for v in values) and len({(v.shape, v.dtype) for v in values}) == 1:
        return np.stack(values)
    return values
