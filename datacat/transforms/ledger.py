"""The bad-sample policy: raise at once, or skip and keep a ledger within a budget.

Never a placeholder: a record that cannot become a sample is either an error
naming its shard and key, or an entry in the ledger and one record fewer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from datacat.errors import BadSampleBudgetExceeded, RecordError
from datacat.schema import BadSamplePolicy

__all__ = ["BadSample", "Ledger"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class BadSample:
    """One record that was skipped, and why."""

    dataset: str
    shard: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.dataset} {self.shard} key {self.key}: {self.reason}"


@dataclasses.dataclass
class Ledger:
    """Counts records, applies the policy to bad ones, and lists what ``skip`` dropped.

    ``budget`` is the fraction of records that may be dropped; it is checked
    against ``expected`` records when the dataset declares them, else
    against the records seen so far (with at least ``min_allowed`` allowed).
    """

    dataset: str
    policy: BadSamplePolicy = "raise"
    budget: float = 0.001
    expected: int | None = None
    min_allowed: int = 1
    seen: int = 0
    skipped: list[BadSample] = dataclasses.field(default_factory=list)

    def apply(self, func: Callable[[Any], T], record: Any, *, shard: str, key: str) -> T | None:
        """``func(record)``, or None after recording why it failed under ``skip``."""
        self.seen += 1
        try:
            return func(record)
        except (ValueError, RecordError) as exc:
            reason = str(exc)
            if self.policy == "raise":
                raise RecordError(
                    f"{self.dataset}: bad sample in shard {shard}, key {key}: {reason}. "
                    "Fix or remove it, or load with on_bad_sample='skip'."
                ) from exc
        self.skip(shard=shard, key=key, reason=reason)
        return None

    def skip(self, *, shard: str, key: str, reason: str) -> None:
        """Records one dropped sample; raises when the budget is spent."""
        self.skipped.append(BadSample(self.dataset, shard, key, reason))
        log.warning("skipped bad sample: %s", self.skipped[-1])
        base = self.expected if self.expected is not None else self.seen
        allowed = max(self.min_allowed, int(self.budget * base))
        if len(self.skipped) > allowed:
            raise BadSampleBudgetExceeded(
                f"{self.dataset}: {len(self.skipped)} bad samples of {self.seen} read, over the budget of "
                f"{allowed} ({self.budget:.3%}). {self.summary()} Raise bad_sample_budget if this is expected."
            )

    def counts(self) -> dict[str, int]:
        """Skipped samples by shard."""
        return dict(Counter(b.shard for b in self.skipped))

    def summary(self) -> str:
        """One line per shard with skips, then the first few reasons."""
        if not self.skipped:
            return f"{self.dataset}: no bad samples in {self.seen} read."
        shards = ", ".join(f"{s} ({n})" for s, n in sorted(self.counts().items()))
        first = "; ".join(str(b) for b in self.skipped[:3])
        return f"{self.dataset}: skipped {len(self.skipped)} of {self.seen}: {shards}. First: {first}"

    def merge(self, other: Ledger) -> None:
        """Adds another process's counts and skips to this ledger."""
        self.seen += other.seen
        self.skipped.extend(other.skipped)
