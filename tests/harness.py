"""One simulated rank, run as its own process: ``python harness.py '<json job>'`` prints a JSON result.

A job names the framework and a list of loads; for each load the rank
reports the keys of every batch, an md5 of each sample's pixels, and its
state after ``stop_after`` batches if asked (and after each count in
``states_at``, going on). Ranks are separate processes
(as under torchrun), each with its own worker processes, so exactly-once and
equal batch counts are checked the way they happen in training.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import numpy as np

import datacat


def _first_array(batch: dict[str, Any]) -> str:
    """``image``, or the first key of the batch holding an array (a prior's embeddings, a plugin's vectors)."""
    if "image" in batch:
        return "image"
    return next(k for k, v in batch.items() if k not in ("key", "label") and not isinstance(v, list))


def run_load(framework: str, load: dict[str, Any]) -> dict[str, Any]:
    options = dict(load)
    name = options.pop("name")
    if "catalog_file" in options:  # a catalog of the test's own, not $DATACAT_CATALOG
        options["catalog"] = datacat.load_catalog(options.pop("catalog_file"))
    state = options.pop("state", None)
    stop_after = options.pop("stop_after", None)
    states_at = options.pop("states_at", [])  # batch counts after which to save the state and go on
    loader = datacat.open(name, framework=framework, **options)
    if state is not None:
        loader.load_state_dict(state)
    batches, pixels, arrays, states = [], {}, [], []
    iterator = iter(loader)
    for i, batch in enumerate(iterator):
        image = batch[_first_array(batch)]  # rows without an image: their format's first array
        if hasattr(image, "sharding"):  # a jax.Array: record how it is laid out
            arrays.append(
                {"type": type(image).__name__, "shape": list(image.shape), "devices": len(image.sharding.device_set)}
            )
        batches.append(list(batch["key"]))
        images = np.asarray(image)
        for key, image in zip(batch["key"], images, strict=True):
            pixels[f"{loader.epoch}:{key}"] = hashlib.md5(np.ascontiguousarray(image).tobytes()).hexdigest()
        if i + 1 in states_at:
            states.append(json.loads(json.dumps(loader.state_dict())))  # a checkpoint while training goes on
        if stop_after is not None and i + 1 == stop_after:
            break
    saved = loader.state_dict() if stop_after is not None else None
    iterator.close()
    loader.close()
    return {
        "batches": batches,
        "pixels": pixels,
        "state": saved,
        "states": states,
        "per_epoch": len(loader),
        "arrays": arrays,
        "retries": loader.retries,
    }


def main() -> None:
    job = json.loads(sys.argv[1])
    results = [run_load(job["framework"], load) for load in job["loads"]]
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
