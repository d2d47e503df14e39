"""Resumable loader state: what a saved state must match to be continued from, and what differs when it does not."""

from __future__ import annotations

from typing import Any

from datacat.errors import PlanMismatch

__all__ = ["MATCHED", "STATE_VERSION", "differences"]

STATE_VERSION = 2
"""2: random access formats are read in global steps (a rank's batch b is not where version 1 put it)."""
MATCHED = ("fingerprint", "rank", "world_size", "batch_size", "drop_remainder", "shuffle", "shuffle_run")
"""Keys of a saved state that must equal the loader's own: the Plan and the world layout."""

_BEFORE = {"shuffle_run": 1}
"""What a state saved before a key was kept meant by its absence."""


def differences(saved: dict[str, Any], mine: dict[str, Any], *, records: int, stream: bool) -> list[str]:
    """How ``saved`` differs from this loader's state ``mine``, one line each; raises on another state version.

    ``records`` is this loader's records in the saved epoch; a ``stream``
    format's order also depends on the worker count.
    """
    if saved.get("version") != STATE_VERSION:
        raise PlanMismatch(
            f"loader state version {saved.get('version')!r} is not {STATE_VERSION}; it was saved by another datacat "
            "(version 1 read each rank's records as one slice, version 2 in global steps): start the epoch again"
        )
    found = [
        f"{key}: saved {saved.get(key, _BEFORE.get(key))!r}, this loader {mine[key]!r}"
        for key in MATCHED
        if saved.get(key, _BEFORE.get(key)) != mine[key]
    ]
    if saved.get("records", records) != records:
        found.append(f"records in epoch {saved['epoch']}: saved {saved['records']}, this loader {records}")
    if stream and saved.get("num_workers") != mine["num_workers"]:
        found.append(
            f"num_workers: saved {saved.get('num_workers')}, this loader {mine['num_workers']} (a stream format's order depends on it)"
        )
    return found
