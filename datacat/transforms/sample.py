"""One raw record to one training sample: decode, resize, augment, caption.

A raw record is the dict every reader yields: ``__key__`` (str),
``__shard__`` (the shard's URL), ``__uid__`` (a stable int id for the
record's rng), ``image`` (encoded bytes or uint8 HxWx3), ``caption``
(str or None), and optionally ``label`` (int) and ``embedding``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from datacat.plan import Plan
from datacat.registry import format_of
from datacat.transforms.augment import augmented, image_augmentations, record_rng
from datacat.transforms.captions import Tokenize, caption_from_label, class_names
from datacat.transforms.decode import decode_image, stored_size
from datacat.transforms.resize import crop_box, resize_image

__all__ = ["ImageTransform", "RowTransform", "transform_for"]


class ImageTransform:
    """Resizes, augments and captions one record, seeded by the record's own rng.

    Picklable (worker processes get copies) and deterministic: the same
    record and seed give the same pixels in any process.
    """

    def __init__(self, plan: Plan, *, tokenize: Tokenize | None = None) -> None:
        self.name = plan.name
        self.size = plan.loading.image_size
        self.max_pixels = plan.loading.max_pixels
        self.resize = plan.loading.resize
        self.augment = image_augmentations(plan.loading.augmentation)
        self.seed = plan.seed
        self.templates = plan.loading.captions.templates
        self.names_path = plan.loading.captions.class_names
        # Image-only sets (tokenizer training, clip-retrieval shards): the entry says caption: null,
        # or its records are single images. Their samples and batches have no "caption".
        self.image_only = (plan.record.caption is None or plan.record.layout == "single") and not self.names_path
        if plan.record.layout == "tf_example" and not self.names_path:  # TFDS writes the names beside the shards
            self.names_path = plan.root.rstrip("/") + "/label.labels.txt"
        self.tokenize = tokenize
        self.arrays = format_of(plan.format).arrays
        self.fields = plan.record.fields
        self.conditioning = plan.loading.size_conditioning

    def __repr__(self) -> str:
        return f"ImageTransform({self.name!r}, size={self.size}, resize={self.resize!r}, augment={self.augment}, seed={self.seed})"

    def __call__(self, record: Mapping[str, Any], *, epoch: int = 0, into: np.ndarray | None = None) -> dict[str, Any]:
        """The sample ``{"image", "caption", "key"}`` (plus ``label``, ``embedding``, ``tokens``) of ``record``.

        An image-only entry's samples have no ``caption`` (nor ``tokens``).
        With ``into`` (a batch's row), the image is resized straight into it
        when no augmentation follows.
        """
        # The record's rng is made only when something draws from it (a Philox costs ~0.08 ms).
        rng = record_rng(self.seed, int(record["__uid__"]), epoch) if self.augment is not None else None
        image = record.get("image")
        if image is None:
            raise ValueError("record has no image")
        # A batch's row says the size: a square of image_size, or its aspect-ratio bucket's.
        target = (int(into.shape[0]), int(into.shape[1])) if into is not None else (self.size, self.size)
        pixels = (
            image
            if isinstance(image, np.ndarray)
            else decode_image(image, at_least=max(target), max_pixels=self.max_pixels)
        )
        decoded = pixels.shape[:2]
        pixels = resize_image(pixels, target, mode=self.resize, into=into if rng is None else None)
        flipped = False
        if rng is not None:
            pixels, flipped = augmented(self.augment, pixels, rng)
        caption = record.get("caption")
        label = record.get("label")
        if caption is None and label is not None and self.names_path:
            rng = rng or record_rng(self.seed, int(record["__uid__"]), epoch)
            caption = caption_from_label(int(label), class_names(self.names_path), self.templates, rng)
        sample: dict[str, Any] = {"image": pixels, "key": str(record["__key__"])}
        if caption is not None:
            sample["caption"] = caption
        elif not self.image_only:
            raise ValueError(
                "record has no caption and no label with class names to make one (an image-only entry says "
                "record.caption: null)"
            )
        if label is not None:
            sample["label"] = int(label)
        for name in self.arrays:
            if record.get(name) is not None:
                sample[name] = record[name]
        for name in self.fields:
            sample[name] = record[name]
        if self.conditioning:
            stored = image.shape[:2] if isinstance(image, np.ndarray) else stored_size(image)
            sample.update(self._size_conditioning(stored, decoded, target, flipped))
        if self.tokenize is not None and caption is not None:
            sample["tokens"] = self.tokenize(caption)
        return sample

    def _size_conditioning(
        self, stored: tuple[int, int], decoded: tuple[int, int], target: tuple[int, int], flipped: bool
    ) -> dict[str, tuple[int, int]]:
        """SDXL's size and crop conditioning of one image: the crop taken from the decoded pixels, in stored pixels.

        A JPEG decoded at a reduction (1/2, 1/4, 1/8) is cropped in the reduced
        pixels; the crop is scaled back by the reduction, so it is exact to
        one reduced pixel. A flipped sample's crop is given in the flipped image.
        """
        (height, width), (rows, cols) = stored, decoded
        top, left, _, crop_w = crop_box(rows, cols, self.resize, target)
        y, x = round(top * height / rows), round(left * width / cols)
        if flipped:
            x = width - x - round(crop_w * width / cols)
        return {"original_size": (height, width), "crop_top_left": (y, x), "target_size": target}


class RowTransform:
    """One record without an image as a sample: its ``key``, its ``caption`` if it has one, and the format's arrays.

    For formats declaring ``rows`` (embedding tables, a plugin's vectors).
    Nothing is drawn: rows are used as they are.
    """

    def __init__(self, plan: Plan, *, tokenize: Tokenize | None = None) -> None:
        self.name = plan.name
        self.arrays = format_of(plan.format).arrays
        self.tokenize = tokenize

    def __repr__(self) -> str:
        return f"RowTransform({self.name!r}, arrays={self.arrays})"

    def __call__(self, record: Mapping[str, Any], *, epoch: int = 0, into: np.ndarray | None = None) -> dict[str, Any]:
        """The sample of one row (``into`` is for images: a row has none)."""
        sample: dict[str, Any] = {"key": str(record["__key__"])}
        for name in self.arrays:
            if record.get(name) is not None:
                sample[name] = record[name]
        caption = record.get("caption")
        if caption is not None:
            sample["caption"] = str(caption)
            if self.tokenize is not None:
                sample["tokens"] = self.tokenize(sample["caption"])
        return sample


def transform_for(plan: Plan, *, tokenize: Tokenize | None = None) -> ImageTransform | RowTransform:
    """The transform of ``plan``'s records: images, or rows without one (embedding tables)."""
    if format_of(plan.format).rows:
        return RowTransform(plan, tokenize=tokenize)
    return ImageTransform(plan, tokenize=tokenize)
