"""The default policy: affinity where it pays, least expected wait everywhere else.

1. Load: each worker's cost is its outstanding work normalised by its batch size
   times its card's speed (a large card is not equal to a small one, nor a fast one
   to a slow one), plus the engine's own queue and a
   penalty once its KV cache nears full. Outstanding work is the larger of what the
   gateways have in flight there (fresh) and what the engine last reported (a
   second old): under KV pressure the queue, not the prefix-cache hit rate, is what
   says a worker is drowning.
2. Affinity: requests that share a prefix (or a session) go to the same worker,
   found on a consistent-hash ring so every gateway replica agrees without talking
   and a worker leaving moves only its own keys. The load is bounded: the home is
   skipped while it carries more than (1 + balance) x its fair share (+ slack) or its
   engine already queues requests, and the next worker on the key's ring takes the
   overflow, so a hot prefix gets a second replica instead of a queue. Capacity is
   KV-aware: a worker whose cache fills before its batch does counts as smaller.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from gateway.routing.base import Choice, RequestFacts, best
from gateway.routing.table import ModelRoutes, Slot


class FleetOptions(msgspec.Struct, kw_only=True, frozen=True):
    # How far above its fair share of the fleet's load an affinity home may go.
    balance: float = 0.25
    # Requests a home may always take beyond its share (keeps affinity at low load); a
    # card slower than the reference gets that much less.
    slack: float = 2.0
    # KV-cache use above which a worker with a queue counts as saturated.
    kv_high: float = 0.9
    kv_weight: float = 2.0
    waiting_weight: float = 1.0
    # Workers tried along a key's ring before falling back to least load.
    max_probes: int = 4
    # A home whose engine queues more than this is skipped: the queue, not the cache, decides.
    home_max_waiting: int = 0
    # Extra cost of sending an adapter where it is not in a slot: with a free slot (a
    # load), and with every slot taken (a load that evicts another adapter).
    lora_load_cost: float = 0.3
    lora_swap_cost: float = 1.5


class FleetPolicy:
    name = "fleet"

    def __init__(self, options: FleetOptions | None = None) -> None:
        self.opts = options or FleetOptions()

    def rank(
        self, candidates: Sequence[Slot], facts: RequestFacts, inflight: Mapping[str, int],
        routes: ModelRoutes, limit: int,
    ) -> list[Choice]:
        opts = self.opts
        get = inflight.get
        kv_high = opts.kv_high
        kv_scale = opts.kv_weight / max(1e-9, 1.0 - kv_high)
        waiting_weight = opts.waiting_weight
        scored: list[tuple[float, str, Slot]] = []
        busy: dict[str, int] = {}
        total_busy = 1
        total_capacity = 0.0
        for s in candidates:
            b = get(s.id, 0)
            if s.engine_busy > b:
                b = s.engine_busy
            c = (b + waiting_weight * s.waiting) / s.weight
            if s.kv > kv_high:
                c += kv_scale * (s.kv - kv_high)
            scored.append((c, s.id, s))
            busy[s.id] = b
            total_busy += b
            total_capacity += s.weight
        if facts.adapter:
            return self._rank_adapter(scored, facts, limit)
        key = facts.affinity_key
        default_reason = "least-load"
        if key is None or len(candidates) == 1:
            return [Choice(x[2], default_reason) for x in best(scored, limit)]
        share = total_busy / total_capacity
        kind = facts.affinity_kind or "prefix"
        probes = 0
        for s in routes.ring_order(key):
            home_busy = busy.get(s.id)
            if home_busy is None:  # drained, already tried, or too short for this prompt
                continue
            bound = (1.0 + opts.balance) * share * s.weight + opts.slack * min(1.0, s.speed)
            if home_busy + 1 <= bound and s.waiting <= opts.home_max_waiting:
                reason = f"{kind}-hit" if probes == 0 else f"{kind}-spill"
                rest = best([x for x in scored if x[2] is not s], limit - 1) if limit > 1 else []
                return [Choice(s, reason), *(Choice(x[2], default_reason) for x in rest[: limit - 1])]
            probes += 1
            if probes >= opts.max_probes:
                break
        return [Choice(x[2], "least-load-overflow") for x in best(scored, limit)]

    def _rank_adapter(
        self, scored: list[tuple[float, str, Slot]], facts: RequestFacts, limit: int
    ) -> list[Choice]:
        """Adapter requests go where the adapter is warm (in a slot), unless load says otherwise:
        every other worker would first have to load it, and evict another when its slots are full."""
        opts = self.opts
        model = facts.model
        warm, full = facts.warm, facts.full
        ranked: list[tuple[float, str, Slot, str]] = []
        for c, wid, s in scored:
            if s.adapters_fit or model in s.lora_active or wid in warm:
                ranked.append((c, wid, s, "adapter-warm"))
            elif wid not in full and len(s.lora_active) < max(s.max_loras, 1):
                ranked.append((c + opts.lora_load_cost, wid, s, "adapter-resident"))
            else:
                ranked.append((c + opts.lora_swap_cost, wid, s, "adapter-resident"))
        return [Choice(x[2], x[3]) for x in best(ranked, limit)]
