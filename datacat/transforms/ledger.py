"""The bad-sample policy: raise at once, or skip and keep a ledger within a budget.

Never a placeholder: a record that cannot become a sample is either an error
naming its shard and key, or an entry in the ledger and one record fewer.
Work done in worker processes comes back as markers (``bad_marker``,
``error_marker``) and the one ledger in the main process applies the
policy, so counts, budget and errors are the same whatever the worker count.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
from collections import Counter
from typing import Any

from datacat.errors import BadSampleBudgetExceeded, DatacatError, OptionError, RecordError, ShardError
from datacat.plan import Plan
from datacat.redact import redact
from datacat.schema import BadSamplePolicy

__all__ = ["BadSample", "Ledger", "bad_marker", "error_marker", "is_marker"]

log = logging.getLogger(__name__)
_BAD, _ERROR = "__bad__", "__error__"
_ERRORS: dict[str, type[Exception]] = {
    "RecordError": RecordError,
    "ShardError": ShardError,
    "OptionError": OptionError,
    "DatacatError": DatacatError,
}


@dataclasses.dataclass(frozen=True)
class BadSample:
    """One record that could not become a sample, and why."""

    dataset: str
    shard: str
    key: str
    reason: str

    def __str__(self) -> str:
        return f"{self.dataset} {self.shard} key {self.key}: {self.reason}"


def bad_marker(bad: BadSample) -> dict[str, Any]:
    """What a worker yields in place of a record that cannot become a sample."""
    return {_BAD: dataclasses.astuple(bad)}


def error_marker(exc: BaseException) -> dict[str, Any]:
    """What a worker yields in place of raising, so the main process raises the same error.

    The exception itself travels (its class and attributes: ``url``, ``key``,
    ``filename``) when it survives pickling unchanged; otherwise its class name
    and redacted message, raised as the nearest datacat class.
    """
    try:
        copy = pickle.loads(pickle.dumps(exc))
    except Exception:  # any exception can fail to pickle in its own way; the fallback below says what it was
        copy = None
    if type(copy) is type(exc) and str(copy) == str(exc):
        return {_ERROR: exc.with_traceback(None)}
    kind = next((name for name, cls in _ERRORS.items() if isinstance(exc, cls)), "DatacatError")
    return {_ERROR: (kind, f"{type(exc).__name__}: {redact(exc)}")}


def is_marker(output: dict[str, Any]) -> bool:
    """Whether a worker's output is a marker rather than a sample."""
    return _BAD in output or _ERROR in output


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

    @classmethod
    def for_plan(cls, plan: Plan, *, policy: BadSamplePolicy | None = None, budget: float | None = None) -> Ledger:
        """The ledger of a Plan: its entry's policy and budget unless the call overrides them."""
        return cls(
            plan.name,
            policy=policy or plan.loading.on_bad_sample,
            budget=plan.loading.bad_sample_budget if budget is None else budget,
            expected=plan.samples,
        )

    def admit(self, output: dict[str, Any]) -> dict[str, Any] | None:
        """The sample in ``output``, or None for a skipped one; raises per the policy or a worker's error."""
        self.seen += 1
        if _ERROR in output:
            error = output[_ERROR]
            if isinstance(error, BaseException):
                raise error
            kind, message = error
            raise _ERRORS.get(kind, DatacatError)(message)
        if _BAD in output:
            bad = BadSample(*output[_BAD])
            if self.policy == "raise":
                raise RecordError(
                    f"{bad.dataset}: bad sample in shard {bad.shard}, key {bad.key}: {bad.reason}. "
                    "Fix or remove it, or load with on_bad_sample='skip'."
                )
            self.skip(bad)
            return None
        return output

    def skip(self, bad: BadSample) -> None:
        """Records one dropped sample; raises when the budget is spent."""
        self.skipped.append(bad)
        # The first few are worth a warning each; the rest are in the ledger and its summary.
        log.log(logging.WARNING if len(self.skipped) <= 10 else logging.DEBUG, "skipped bad sample: %s", bad)
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

    def state(self) -> dict[str, Any]:
        """The counts and skips as JSON-able data, for a loader's saved state."""
        return {"seen": self.seen, "skipped": [dataclasses.astuple(b) for b in self.skipped]}

    def restore(self, state: dict[str, Any]) -> None:
        """Counts and skips from ``state()``."""
        self.seen = int(state["seen"])
        self.skipped = [BadSample(*b) for b in state["skipped"]]
