"""RGB uint8 pixels to a square of the training size: crop, squash or pad."""

from __future__ import annotations

# OpenCV's resize is several times faster than Pillow's at equal quality; imported
# here, where an image is about to be resized, so reading text never loads it.
import cv2
import numpy as np

from datacat.schema import ResizeMode

__all__ = ["resize_image"]


def resize_image(image: np.ndarray, size: int, *, mode: ResizeMode = "center_crop") -> np.ndarray:
    """``image`` as a ``size`` x ``size`` square; area interpolation down, cubic up.

    ``center_crop`` keeps the central square, ``squash`` scales each side on
    its own, ``pad`` fits the long side and pads the rest with white.
    """
    height, width = image.shape[:2]
    if mode == "center_crop":
        side = min(height, width)
        top, left = (height - side) // 2, (width - side) // 2
        return _scale(image[top : top + side, left : left + side], size, size)
    if mode == "squash":
        return _scale(image, size, size)
    if mode == "pad":
        scale = size / max(height, width)
        new_h, new_w = max(1, round(height * scale)), max(1, round(width * scale))
        scaled = _scale(image, new_h, new_w)
        out = np.full((size, size, 3), 255, dtype=np.uint8)
        top, left = (size - new_h) // 2, (size - new_w) // 2
        out[top : top + new_h, left : left + new_w] = scaled
        return out
    raise ValueError(f"unknown resize mode {mode!r}; use center_crop, squash or pad")


def _scale(image: np.ndarray, height: int, width: int) -> np.ndarray:
    if image.shape[0] == height and image.shape[1] == width:
        return np.ascontiguousarray(image)
    shrinking = height * width <= image.shape[0] * image.shape[1]
    interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_CUBIC
    out: np.ndarray = cv2.resize(np.ascontiguousarray(image), (width, height), interpolation=interpolation)
    return out
