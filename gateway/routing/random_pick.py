"""Random choice among the eligible workers: a baseline for the benchmark.

Seeded by the request counter so a run is reproducible; there is no per-replica
random state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fleetgate.hashing import mix
from fleetgate.schema import WorkerView
from gateway.routing.base import Choice, RequestFacts


class RandomPick:
    name = "random"

    def rank(
        self, candidates: Sequence[WorkerView], facts: RequestFacts, inflight: Mapping[str, int]
    ) -> list[Choice]:
        ordered = sorted(candidates, key=lambda w: mix(facts.seq, w.id_hash))
        return [Choice(w, "random") for w in ordered]
