"""A small deterministic encoder for `datacat embed` tests and the README: no model download.

``tiny(images, captions)``: the image side is each image's mean colour over
a 4 x 4 grid (48 floats); the text side is a 48-float code of the caption's
bytes. The same image always gives the same row, whatever the batch.
"""

from __future__ import annotations

import hashlib

import numpy as np


def tiny(images: np.ndarray, captions: list[str]) -> dict[str, np.ndarray]:
    n, height, width, _ = images.shape
    grid = images[:, : height // 4 * 4, : width // 4 * 4].astype(np.float32)
    cells = grid.reshape(n, 4, height // 4, 4, width // 4, 3).mean(axis=(2, 4)) / 255.0
    text = np.stack(
        [np.frombuffer(hashlib.sha384(c.encode()).digest(), np.uint8).astype(np.float32) / 255.0 for c in captions]
    )
    return {"image": cells.reshape(n, 48), "text": text}
