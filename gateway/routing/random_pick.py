"""Random choice among the eligible workers: a baseline for the benchmark.

Seeded by the request counter so a run is reproducible; there is no per-replica
random state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self

from fleetgate.hashing import mix
from gateway.routing.base import Choice, Live, RequestFacts, best
from gateway.routing.table import ModelRoutes, Slot


class RandomPick:
    name = "random"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """The `routing` knobs tune the fleet policy only; this one takes none."""
        return cls()

    def rank(
        self, candidates: Sequence[Slot], facts: RequestFacts, live: Live, routes: ModelRoutes, limit: int,
    ) -> list[Choice]:
        seq = facts.seq
        keyed = [(mix(seq, s.id_hash), s.id, s) for s in candidates]
        return [Choice(k[2], "random") for k in best(keyed, limit)]
