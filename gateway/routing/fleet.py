"""The default policy: affinity where it pays, least expected wait everywhere else.

1. Load: each worker's cost is its outstanding work normalised by its batch size
   (a large card is not equal to a small one), plus the engine's own queue and a
   penalty once its KV cache nears full. Outstanding work is the larger of what the
   gateways have in flight there (fresh) and what the engine last reported (a
   second old): under KV pressure the queue, not the prefix-cache hit rate, is what
   says a worker is drowning.
2. Affinity: requests that share a prefix (or a session) go to the same worker,
   chosen by rendezvous hashing so every gateway replica agrees without talking, and
   so a worker leaving moves only its own keys. The load is bounded: the home worker
   is skipped while it carries more than (1 + balance) x its fair share, and the
   next worker in the key's rendezvous order takes the overflow, so a hot prefix
   gets a second replica instead of a queue.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from fleetgate.hashing import mix
from fleetgate.schema import WorkerView
from gateway.routing.base import Choice, RequestFacts


class FleetOptions(msgspec.Struct, kw_only=True, frozen=True):
    # How far above its fair share of the fleet's load an affinity home may go.
    balance: float = 0.25
    # Requests a home may always take beyond its share (keeps affinity at low load).
    slack: float = 2.0
    # KV-cache use above which a worker is treated as saturated.
    kv_high: float = 0.9
    kv_weight: float = 2.0
    waiting_weight: float = 1.0


def busy(worker: WorkerView, inflight: Mapping[str, int]) -> int:
    load = worker.load
    return max(inflight.get(worker.id, 0), load.running + load.waiting)


def cost(worker: WorkerView, inflight: Mapping[str, int], opts: FleetOptions) -> float:
    capacity = max(worker.info.capacity, 1)
    load = worker.load
    kv_excess = max(0.0, load.kv_cache_usage - opts.kv_high) / max(1e-9, 1.0 - opts.kv_high)
    return (
        busy(worker, inflight) / capacity
        + opts.waiting_weight * load.waiting / capacity
        + opts.kv_weight * kv_excess
    )


def saturated(worker: WorkerView, opts: FleetOptions) -> bool:
    return worker.load.waiting > 0 and worker.load.kv_cache_usage >= opts.kv_high


class FleetPolicy:
    name = "fleet"

    def __init__(self, options: FleetOptions | None = None) -> None:
        self.opts = options or FleetOptions()

    def rank(
        self, candidates: Sequence[WorkerView], facts: RequestFacts, inflight: Mapping[str, int]
    ) -> list[Choice]:
        opts = self.opts
        by_cost = sorted(candidates, key=lambda w: (cost(w, inflight, opts), w.id))
        resident_reason = "adapter-resident" if facts.adapter else "least-load"
        if facts.affinity_key is None or len(candidates) == 1:
            return [Choice(w, resident_reason) for w in by_cost]
        total_busy = sum(busy(w, inflight) for w in candidates) + 1
        total_capacity = sum(max(w.info.capacity, 1) for w in candidates)
        share = total_busy / total_capacity
        key = facts.affinity_key
        homes = sorted(candidates, key=lambda w: mix(key, w.id_hash), reverse=True)
        kind = facts.affinity_kind or "prefix"
        for rank_, home in enumerate(homes):
            limit = (1.0 + opts.balance) * share * max(home.info.capacity, 1) + opts.slack
            if busy(home, inflight) + 1 <= limit and not saturated(home, opts):
                reason = f"{kind}-hit" if rank_ == 0 else f"{kind}-spill"
                rest = [Choice(w, resident_reason) for w in by_cost if w.id != home.id]
                return [Choice(home, reason), *rest]
        return [Choice(w, "least-load-overflow") for w in by_cost]
