"""A Plan's samples, framework-free: reader, holdout and count, bad-sample policy, transform.

Both backends run these same steps, so a record means the same thing in
torch and jax. Positions are canonical: shards in plan order, records in
shard order, bad records included, so the holdout and ``count`` select the
same records whatever is skipped or however the work is split.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from datacat.errors import OptionError
from datacat.formats import RawItem, open_reader
from datacat.resolve import Plan
from datacat.schema import BadSamplePolicy
from datacat.transforms.captions import Tokenize
from datacat.transforms.ledger import Ledger
from datacat.transforms.sample import ImageTransform

__all__ = ["SampleSource", "selected_range"]


def selected_range(plan: Plan, total: int) -> range:
    """The canonical positions a plan reads out of ``total`` records: holdout and count applied."""
    head = plan.holdout_records
    if plan.from_holdout:
        return range(min(head, total))
    if head and head >= total:
        raise OptionError(
            f"{plan.name}: the validation holdout ({plan.loading.val_batches} batches x {plan.batch_size} = {head} records) "
            f"is the whole dataset ({total} records); lower val_batches"
        )
    stop = total if plan.loading.count is None else min(total, head + plan.loading.count)
    return range(head, stop)


class SampleSource:
    """The samples of one Plan, by canonical position (random access) or shard by shard (stream)."""

    def __init__(
        self,
        plan: Plan,
        *,
        tokenize: Tokenize | None = None,
        on_bad_sample: BadSamplePolicy | None = None,
        bad_sample_budget: float | None = None,
    ) -> None:
        self.plan = plan
        self.reader = open_reader(plan)
        self.transform = ImageTransform(plan, tokenize=tokenize)
        self.ledger = Ledger(
            plan.name,
            policy=on_bad_sample or plan.loading.on_bad_sample,
            budget=plan.loading.bad_sample_budget if bad_sample_budget is None else bad_sample_budget,
            expected=plan.samples,
        )

    def __repr__(self) -> str:
        return f"SampleSource({self.reader!r}, {self.transform!r}, policy={self.ledger.policy!r})"

    @property
    def random_access(self) -> bool:
        """Whether samples can be read by position (``len`` and ``sample``)."""
        return hasattr(self.reader, "item")

    def __len__(self) -> int:
        if not self.random_access:
            raise TypeError(f"{self.plan.name} is a stream format; it has no length before it is read")
        return len(self.selection())

    def selection(self) -> range:
        """The canonical positions this source reads (random access)."""
        return selected_range(self.plan, len(self.reader))

    def sample(self, index: int) -> dict[str, Any] | None:
        """The sample at selected position ``index``, or None when the skip policy dropped it."""
        item = self.reader.item(self.selection()[index])
        return self._apply(item)

    def _apply(self, item: RawItem) -> dict[str, Any] | None:
        return self.ledger.apply(lambda it: self.transform(self.reader.parse(it)), item, shard=item.shard, key=item.key)

    def shard_offsets(self) -> list[int]:
        """The canonical position of each shard's first record; needs per-shard counts."""
        counts = [s.samples for s in self.plan.shards]
        if any(c is None for c in counts):
            raise OptionError(
                f"{self.plan.name}: splitting its shards while holding out or counting records needs the records per "
                "shard; declare totals.per_shard in the catalog entry"
            )
        offsets, total = [], 0
        for c in counts:
            offsets.append(total)
            total += c or 0
        return offsets

    def iter_samples(self, shards: Sequence[int] | None = None) -> Iterator[dict[str, Any]]:
        """The samples of ``shards`` (default all, in order), selection and policy applied."""
        order = list(range(len(self.plan.shards))) if shards is None else list(shards)
        plan = self.plan
        if not (plan.holdout_records or plan.loading.count is not None or plan.from_holdout):
            for shard in order:
                for item in self.reader.iter_shard(shard):
                    if (sample := self._apply(item)) is not None:
                        yield sample
            return
        # Read in order from the first shard, positions are counted on the way;
        # any other order needs each shard's first position up front.
        offsets = None if order == list(range(len(order))) else self.shard_offsets()
        total = plan.samples if plan.samples_exact and plan.samples is not None else 1 << 62
        wanted = selected_range(plan, total)
        position = 0
        for shard in order:
            if offsets is not None:
                position = offsets[shard]
                count = plan.shards[shard].samples or 0
                if position + count <= wanted.start or position >= wanted.stop:
                    continue  # no selected record in this shard: leave it unopened
            elif position >= wanted.stop:
                return
            for item in self.reader.iter_shard(shard):
                here, position = position, position + 1
                if here >= wanted.stop:
                    break
                if here >= wanted.start and (sample := self._apply(item)) is not None:
                    yield sample
