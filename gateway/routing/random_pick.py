"""Random choice among the eligible workers: a baseline for the benchmark.

Seeded by the request counter so a run is reproducible; there is no per-replica
random state.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetgate.hashing import mix
from gateway.routing.base import Choice, Live, RequestFacts, best
from gateway.routing.table import ModelRoutes, Slot
from gateway.routing.untuned import Untuned


class RandomPick(Untuned):
    name = "random"

    def rank(
        self, candidates: Sequence[Slot], facts: RequestFacts, live: Live, routes: ModelRoutes, limit: int,
    ) -> list[Choice]:
        seq = facts.seq
        keyed = [(mix(seq, s.id_hash), s.id, s) for s in candidates]
        return [Choice(k[2], "random") for k in best(keyed, limit)]
