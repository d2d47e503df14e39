"""Augmentations, each draw from the record's own rng so any worker layout gives the same pixels."""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from datacat.schema import Augmentation

__all__ = ["Augment", "augment_image", "augmented", "image_augmentations", "record_rng"]

# Colour jitter ranges, as torchvision's ColorJitter(0.2, 0.2, 0.2).
_BRIGHTNESS = 0.2
_CONTRAST = 0.2
_SATURATION = 0.2
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Augment:
    """Which augmentations a mode applies: flip for flip_only, both for flip_jitter."""

    flip: bool
    jitter: bool


def image_augmentations(mode: Augmentation) -> Augment | None:
    """The augmentations ``mode`` names; ``none`` (deterministic evaluation) is no Augment at all."""
    if mode == "none":
        return None
    if mode == "flip_only":
        return Augment(flip=True, jitter=False)
    if mode == "flip_jitter":
        return Augment(flip=True, jitter=True)
    raise ValueError(f"unknown augmentation {mode!r}; use none, flip_only or flip_jitter")


def record_rng(seed: int, uid: int, epoch: int = 0) -> np.random.Generator:
    """The rng of one record in one epoch: a Philox keyed by (seed, epoch) and the record's stable id."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return np.random.Generator(np.random.Philox(key=(int.from_bytes(digest, "little") << 64) | (uid & (2**64 - 1))))


def augment_image(augment: Augment | None, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Flips and colour-jitters ``image``, seeded by the record's own rng.

    uint8 pixels go through float32 and are rounded and clipped once at the end.
    Every draw is made whatever the outcome, so the rng advances the same way
    for every record.
    """
    return augmented(augment, image, rng)[0]


def augmented(augment: Augment | None, image: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, bool]:
    """:func:`augment_image`'s pixels, and whether they were flipped left to right."""
    if augment is None:
        return image, False
    flip = rng.random() < 0.5
    factors = rng.uniform(-1.0, 1.0, size=3).astype(np.float32)
    flipped = augment.flip and flip
    out: np.ndarray = image[:, ::-1] if flipped else image
    if not augment.jitter:
        return np.ascontiguousarray(out), flipped
    brightness = 1.0 + _BRIGHTNESS * factors[0]
    contrast = 1.0 + _CONTRAST * factors[1]
    saturation = 1.0 + _SATURATION * factors[2]
    pixels = out.astype(np.float32) * brightness
    grey = pixels @ _LUMA
    pixels = (pixels - grey.mean()) * contrast + grey.mean()
    grey = (pixels @ _LUMA)[..., None]
    pixels = grey + (pixels - grey) * saturation
    jittered: np.ndarray = np.clip(np.rint(pixels), 0, 255).astype(np.uint8)
    return jittered, flipped
