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
from datacat.transforms.augment import augment_image, image_augmentations, record_rng
from datacat.transforms.captions import Tokenize, caption_from_label, class_names
from datacat.transforms.decode import decode_image
from datacat.transforms.resize import resize_image

__all__ = ["EmbeddingRowTransform", "ImageTransform", "transform_for"]


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
        pixels = (
            image
            if isinstance(image, np.ndarray)
            else decode_image(image, at_least=self.size, max_pixels=self.max_pixels)
        )
        pixels = resize_image(pixels, self.size, mode=self.resize, into=into if rng is None else None)
        if rng is not None:
            pixels = augment_image(self.augment, pixels, rng)
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
        if record.get("embedding") is not None:
            sample["embedding"] = record["embedding"]
        if self.tokenize is not None and caption is not None:
            sample["tokens"] = self.tokenize(caption)
        return sample


class EmbeddingRowTransform:
    """One embedding-table row as a sample: ``image_embedding``, ``text_embedding``, ``caption``, ``key``; no image.

    Nothing is drawn: a prior's rows are used as they are.
    """

    def __init__(self, plan: Plan, *, tokenize: Tokenize | None = None) -> None:
        self.name = plan.name
        self.captions = plan.prior is not None and plan.prior.captions
        self.tokenize = tokenize

    def __repr__(self) -> str:
        return f"EmbeddingRowTransform({self.name!r})"

    def __call__(self, record: Mapping[str, Any], *, epoch: int = 0, into: np.ndarray | None = None) -> dict[str, Any]:
        """The sample of one row (``into`` is for images: a row has none)."""
        sample: dict[str, Any] = {"key": str(record["__key__"]), "image_embedding": record["image_embedding"]}
        if record.get("text_embedding") is not None:
            sample["text_embedding"] = record["text_embedding"]
        if self.captions:
            sample["caption"] = str(record.get("caption") or "")
            if self.tokenize is not None:
                sample["tokens"] = self.tokenize(sample["caption"])
        return sample


def transform_for(plan: Plan, *, tokenize: Tokenize | None = None) -> ImageTransform | EmbeddingRowTransform:
    """The transform of ``plan``'s records: images, or the rows of embedding tables."""
    if format_of(plan.format).rows:
        return EmbeddingRowTransform(plan, tokenize=tokenize)
    return ImageTransform(plan, tokenize=tokenize)
