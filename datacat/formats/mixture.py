"""Mixtures have no reader of their own: the backends read each component with its reader."""

from __future__ import annotations

from datacat.resolve import Plan

__all__ = ["MixtureReader"]


class MixtureReader:
    """The readers of a mixture's components, with their normalised weights."""

    def __init__(self, plan: Plan) -> None:
        from datacat.formats import open_reader

        self.name = plan.name
        self.weights = tuple(c.weight for c in plan.components)
        self.readers = tuple(open_reader(c.plan) for c in plan.components)
        self.exhaustion = plan.exhaustion

    def __repr__(self) -> str:
        return f"MixtureReader({self.name!r}, {len(self.readers)} components, exhaustion={self.exhaustion})"
