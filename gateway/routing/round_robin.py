"""Round-robin over the eligible workers, driven by the gateway's request counter."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fleetgate.schema import WorkerView
from gateway.routing.base import Choice, RequestFacts


class RoundRobin:
    name = "round_robin"

    def rank(
        self, candidates: Sequence[WorkerView], facts: RequestFacts, inflight: Mapping[str, int]
    ) -> list[Choice]:
        ordered = sorted(candidates, key=lambda w: w.id)
        start = facts.seq % len(ordered)
        rotated = ordered[start:] + ordered[:start]
        return [Choice(w, "round-robin") for w in rotated]
