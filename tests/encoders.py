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


def fails_on_key_00010002(images: np.ndarray, captions: list[str]) -> dict[str, np.ndarray]:
    """``tiny``, except that it raises for the record whose caption is ``caption of 00010002``."""
    if "caption of 00010002" in captions:
        raise ValueError("this encoder cannot take that image")
    return tiny(images, captions)


def kills_its_worker_once(images: np.ndarray, captions: list[str]) -> dict[str, np.ndarray]:
    """``tiny``, except that the first call anywhere SIGKILLs its own process (the marker file says it happened).

    The marker is ``$DATACAT_TEST_KILL_MARKER``, set by the dask cluster fixture for its workers.
    """
    import os
    import signal

    marker = os.environ.get("DATACAT_TEST_KILL_MARKER")
    if marker and not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return tiny(images, captions)
