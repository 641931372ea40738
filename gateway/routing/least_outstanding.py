"""Least outstanding requests: the gateway's in-flight count plus the engine's own queue."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.base import Choice, Live, RequestFacts, best
from gateway.routing.table import ModelRoutes, Slot
from gateway.routing.untuned import Untuned


class LeastOutstanding(Untuned):
    name = "least_outstanding"

    def rank(
        self, candidates: Sequence[Slot], facts: RequestFacts, live: Live, routes: ModelRoutes, limit: int,
    ) -> list[Choice]:
        get = live.requests.get
        # Ties go to the larger engine (more free batch slots), then to the id, so every
        # gateway replica given the same snapshot makes the same choice.
        keyed = [
            ((n := get(s.id, 0) + s.waiting), n / s.capacity, s.id, s) for s in candidates
        ]
        return [Choice(k[3], "least-load") for k in best(keyed, limit)]
