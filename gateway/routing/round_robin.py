"""Round-robin over the eligible workers, driven by the gateway's request counter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

from gateway.routing.base import Choice, Live, RequestFacts
from gateway.routing.table import ModelRoutes, Slot


class RoundRobin:
    name = "round_robin"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """The `routing` knobs tune the fleet policy only; this one takes none."""
        return cls()

    def rank(
        self, candidates: Sequence[Slot], facts: RequestFacts, live: Live, routes: ModelRoutes, limit: int,
    ) -> list[Choice]:
        # Candidates arrive in id order (the route table keeps them sorted).
        n = len(candidates)
        start = facts.seq % n
        return [Choice(candidates[(start + i) % n], "round-robin") for i in range(min(limit, n))]
