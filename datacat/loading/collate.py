"""Collation: a batch's samples as numpy arrays and lists, its images left in the rows they were resized into."""

from __future__ import annotations

from typing import Any

import numpy as np

from datacat.plan import Plan
from datacat.registry import MIXTURE, format_of

__all__ = ["array_keys", "collate_numpy"]


def array_keys(plan: Plan) -> tuple[str, ...]:
    """The batch keys of ``plan`` that hold one array per sample: ``image``, ``label`` and its format's arrays.

    A mixture's are those of its components together.
    """
    if plan.format == MIXTURE:
        found = [key for component in plan.components for key in array_keys(component.plan)]
        return tuple(dict.fromkeys(found))
    return ("image", "label", *format_of(plan.format).arrays)


def collate_numpy(
    samples: list[dict[str, Any]], images: np.ndarray | None, arrays: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A batch of samples as numpy arrays (image, label, the format's ``arrays``) and lists (caption, key, tokens).

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
    return batch
