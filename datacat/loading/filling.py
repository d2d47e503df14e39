"""A batch read straight into its buffers by its format's BatchFill, then finished as the record path finishes one.

The record path reads, parses and transforms each record, then collates.
When the format can fill a batch (:class:`~datacat.registry.BatchFill`:
pre-resized pixels, embedding rows), its arrays are written once, into the
batch's own buffers, and only the small fields (key, caption, label) go
through Python. What the fill left (a record it could not read as plain
bytes, a bad row) goes through the record path, alone, into its row; so a
batch holds the same samples, in the same order, with the same markers for
the ledger, whichever path made it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from datacat.errors import DatacatError
from datacat.loading import reuse
from datacat.loading.sources import EpochView, SampleSource
from datacat.registry import BatchFill, Filled
from datacat.transforms.augment import augment_image, record_rng
from datacat.transforms.ledger import is_marker
from datacat.transforms.sample import ImageTransform

__all__ = ["FilledBatch", "batch_fill", "fill_batch", "fills_in_process", "finish_filled", "source_fill"]

FilledBatch = tuple[Sequence[int], np.ndarray, dict[str, np.ndarray], Filled]
"""A batch as filled: its indices in the view, their canonical positions, the buffers, what the fill read."""


def batch_fill(view: Any) -> BatchFill | None:
    """The BatchFill of a view's source (:func:`source_fill`); None for a mixture's, whose records come from several."""
    return source_fill(view.source) if isinstance(view, EpochView) else None


def source_fill(source: Any) -> BatchFill | None:
    """The BatchFill of a source, when its transform keeps the filled arrays as they are; else None.

    Captions drawn from class names need each record's rng, and record
    fields and size conditioning each record's parse, so such entries take
    the record path.
    """
    if not isinstance(source, SampleSource):
        return None
    transform = source.transform
    if isinstance(transform, ImageTransform) and transform.names_path:
        return None
    if source.plan.record.fields or source.plan.loading.size_conditioning or source.bucketing is not None:
        return None
    return source.fill


def fills_in_process(source: Any) -> bool:
    """Whether a source's batches are copies that release the GIL: threads of the loader's own process fill them.

    Worker processes would only copy such a batch once more to hand it
    over (embedding rows: 2 workers ran at 0.6x of none). Colour jitter is
    per-image float work after the copy: there workers pay.
    """
    fill = source_fill(source)
    transform = source.transform if fill is not None else None
    jitter = isinstance(transform, ImageTransform) and transform.augment is not None and transform.augment.jitter
    return fill is not None and not jitter


def fill_batch(
    view: EpochView,
    fill: BatchFill,
    indices: Sequence[int],
    allocate: Callable[[tuple[int, ...]], np.ndarray] | None,
) -> FilledBatch | None:
    """The records at ``indices`` of ``view`` read into buffers (images from ``allocate``, else reused); None if a shard fails.

    A shard that cannot be read is left to the record path, which marks
    each of its records with the error as it always has.
    """
    positions = view.positions_array(indices)
    buffers = {
        key: allocate((len(positions), *shape))
        if key == "image" and allocate
        else reuse.take((len(positions), *shape), dtype)
        for key, (shape, dtype) in fill.arrays.items()
    }
    try:
        filled = fill.fill(positions, buffers)
    except (DatacatError, OSError):
        return None
    return indices, positions, buffers, filled


def finish_filled(view: EpochView, filled_batch: FilledBatch) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The collated batch and the ledger's markers of a filled batch, as the record path would make them."""
    indices, positions, buffers, filled = filled_batch
    transform = view.source.transform
    fields = filled.fields
    n = len(positions)
    redone: dict[int, dict[str, Any]] = {}
    for slot, error in filled.left.items():  # through the record path, alone, into its row
        if error is not None:
            redone[slot] = view.source.outcome(error, int(positions[slot]), epoch=view.epoch)
            continue
        row = buffers["image"][slot : slot + 1] if "image" in buffers else None
        (redone[slot],) = view.finish(view.fetch([indices[slot]]), into=row)
    image_only = isinstance(transform, ImageTransform) and transform.image_only
    captions = fields.get("caption")
    if isinstance(transform, ImageTransform) and not image_only and captions is not None:
        for slot, caption in enumerate(captions):  # the record path's error for a record without a caption
            if caption is None and slot not in redone:
                (redone[slot],) = view.finish(view.fetch([indices[slot]]), into=buffers["image"][slot : slot + 1])
    marks = [redone[slot] for slot in sorted(redone) if is_marker(redone[slot])]
    dropped = {slot for slot, output in redone.items() if is_marker(output)}
    good: Sequence[int] = [slot for slot in range(n) if slot not in dropped] if dropped else range(n)
    kept_redone = redone.keys() - dropped

    def column(key: str) -> Sequence[Any]:
        if not redone:
            return fields[key]
        return [fields[key][slot] if slot not in redone else redone[slot].get(key) for slot in good]

    batch: dict[str, Any] = {"key": column("key")}
    augment = transform.augment if isinstance(transform, ImageTransform) else None
    seed = transform.seed if isinstance(transform, ImageTransform) else 0
    for key, buffer in buffers.items():
        for slot in kept_redone:  # a redone record's array made elsewhere (an embedding row)
            array = redone[slot][key]
            if not np.may_share_memory(array, buffer[slot]):
                buffer[slot] = array
        if augment is not None and key == "image":
            for slot in good:
                if slot not in redone:  # the record path augmented its own
                    rng = record_rng(seed, int(positions[slot]), view.epoch)
                    buffer[slot] = augment_image(augment, buffer[slot], rng)
        if dropped:  # rows after a bad record move up
            buffer[: len(good)] = buffer[list(good)]
        batch[key] = buffer[: len(good)]
    if captions is not None and not image_only:
        batch["caption"] = column("caption")
    labels = column("label") if "label" in fields else None
    if labels and all(label is not None for label in labels):
        batch["label"] = np.asarray(labels, dtype=np.int64)
    tokenize = transform.tokenize
    if tokenize is not None and "caption" in batch:
        batch["tokens"] = [tokenize(caption) for caption in batch["caption"]]
    return batch, marks
