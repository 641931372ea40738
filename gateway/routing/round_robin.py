"""Round-robin over the eligible workers, driven by the gateway's request counter."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.base import Choice, Live, RequestFacts
from gateway.routing.table import ModelRoutes, Slot
from gateway.routing.untuned import Untuned


class RoundRobin(Untuned):
    name = "round_robin"

    def rank(
        self, candidates: Sequence[Slot], facts: RequestFacts, live: Live, routes: ModelRoutes, limit: int,
    ) -> list[Choice]:
        # Candidates arrive in id order (the route table keeps them sorted).
        n = len(candidates)
        start = facts.seq % n
        return [Choice(candidates[(start + i) % n], "round-robin") for i in range(min(limit, n))]
