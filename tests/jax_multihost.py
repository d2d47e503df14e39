"""One process of a multi-host jax job on this machine: ``python jax_multihost.py '<json job>'`` prints a JSON result.

The job names the coordinator's port, the process count and this process's
id, the catalog and entry, and the loader's options. The process starts
``jax.distributed`` on 127.0.0.1 with 2 CPU devices of its own, opens the
entry with ``device_put=True`` (rank and world from jax) and, beside it, the
same loader without (its plain numpy batches), and reports for every batch
its keys, the global array's shape and whether this process addresses all
of it, and whether the rows it addresses are its own plain batch's.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np

import datacat


def main() -> None:
    job = json.loads(sys.argv[1])
    jax.distributed.initialize(
        f"127.0.0.1:{job['port']}", num_processes=job["processes"], process_id=job["process"], initialization_timeout=90
    )
    catalog = datacat.load_catalog(job["catalog"])
    options = job["options"]
    placed = datacat.open(job["name"], catalog=catalog, framework="jax", device_put=True, **options)
    plain = datacat.open(job["name"], catalog=catalog, framework="jax", **options)
    if job.get("state"):
        placed.load_state_dict(job["state"])
        plain.load_state_dict(job["state"])
    out: dict = {"rank": placed.rank, "world": placed.world_size, "batches": [], "state": None}
    for i, (batch, mine) in enumerate(zip(placed, plain, strict=True)):
        image = batch["image"]
        shards = sorted(image.addressable_shards, key=lambda s: s.index[0].start)
        local = np.concatenate([np.asarray(s.data) for s in shards])
        out["batches"].append(
            {
                "keys": list(batch["key"]),
                "shape": list(image.shape),
                "fully_addressable": image.is_fully_addressable,
                "own_rows": bool(np.array_equal(local, np.asarray(mine["image"]))) and batch["key"] == mine["key"],
                "first_row": shards[0].index[0].start,
            }
        )
        if job.get("stop_after") == i + 1:
            out["state"] = placed.state_dict()
            break
    placed.close()
    plain.close()
    print("RESULT " + json.dumps(out), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
