"""Least outstanding requests: the gateway's in-flight count plus the engine's own queue."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fleetgate.schema import WorkerView
from gateway.routing.base import Choice, RequestFacts


def outstanding(worker: WorkerView, inflight: Mapping[str, int]) -> int:
    return inflight.get(worker.id, 0) + worker.load.waiting


class LeastOutstanding:
    name = "least_outstanding"

    def rank(
        self, candidates: Sequence[WorkerView], facts: RequestFacts, inflight: Mapping[str, int]
    ) -> list[Choice]:
        # Ties go to the larger engine (more free batch slots), then to the id, so every
        # gateway replica given the same snapshot makes the same choice.
        ordered = sorted(
            candidates,
            key=lambda w: (
                outstanding(w, inflight),
                outstanding(w, inflight) / max(w.info.capacity, 1),
                w.id,
            ),
        )
        return [Choice(w, "least-load") for w in ordered]
