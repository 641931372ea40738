"""The default policy: a placed home for every affinity key, least load everywhere else.

1. Load: each worker's cost is the larger of its sequence use (requests in flight by the
   gateways' own account, fresh, plus half of what the engine reports beyond that, which is
   other clients' work) and its KV use (what the engine measured in its last report plus
   what its report does not cover yet, over the cache size it declared; where it measures
   none, the KV tokens the gateway's requests hold by its estimate), divided by its card's
   speed. A jitter of a few percent (a hash of the request counter, so still pure)
   breaks near-ties differently for each request, so concurrent decisions and replicas do
   not move together.
2. Affinity: a key (system prompt, session, prompt head) is placed once on the worker with
   the least work already placed there per unit of capacity (`gateway/routing/homes.py`),
   which partitions the working set across the fleet; its requests then go home. Only a
   heavy key (a hot tenant, `heavy_share` of its home's work) whose home is saturated by
   the account (its sequence slots, or `kv_high` of its KV cache) gets a second home: the
   least loaded worker with room, kept for a while (hysteresis) and shared with the home
   by load. Light keys stay home; the background rebalance moves them when a worker's
   placed work is above its share.
3. Adapters: where the adapter is warm, else a free slot, else a swap, load permitting.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Self

import msgspec

from gateway.routing.base import Choice, Live, RequestFacts, best, kv_in_use
from gateway.routing.records import FleetOptions
from gateway.routing.table import ModelRoutes, Slot

_JITTER_SCALE = 1.0 / 65536


class FleetPolicy:
    name: ClassVar[str] = "fleet"

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        """The policy tuned by the `routing` settings (see FleetOptions)."""
        try:
            return cls(msgspec.convert(dict(options), FleetOptions))
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad `routing` setting for the fleet policy: {exc}") from None

    def __init__(self, options: FleetOptions | None = None) -> None:
        self.opts = options or FleetOptions()

    def saturated(self, s: Slot, live: Live) -> bool:
        """At its sequence slots by the gateway's account, or at `kv_high` of its KV cache (the
        engine's measured use and the prediction since its report; the account where it
        measures none)."""
        if live.requests.get(s.id, 0) >= s.capacity:
            return True
        if s.kv_tokens:
            return kv_in_use(s, live) >= self.opts.kv_high * s.kv_tokens
        return s.waiting > 0 and s.kv >= self.opts.kv_high

    def rank(
        self, candidates: Sequence[Slot], facts: RequestFacts, live: Live, routes: ModelRoutes, limit: int,
    ) -> list[Choice]:
        opts = self.opts
        requests = live.requests.get
        tokens = live.tokens.get
        fresh = live.fresh.get
        foreign_weight = opts.foreign_weight
        # A cheap per-request spread: the slot's fixed 16 bits mixed with the request counter's.
        jitter = opts.jitter * _JITTER_SCALE
        spin = (facts.seq * 0x9E3779B1) & 0xFFFF
        home_id, second_id = facts.home, facts.second
        home = second = None
        scored: list[tuple[float, str, Slot]] = []
        for s in candidates:
            wid = s.id
            r = requests(wid, 0)
            foreign = s.engine_busy - r
            seats = (r + foreign_weight * foreign if foreign > 0 else r) / s.capacity
            if s.measured:  # the engine's figure, and what its report does not cover yet
                kv = (s.kv_held + fresh(wid, 0)) / s.kv_tokens
            else:
                kv = tokens(wid, 0) / s.kv_tokens if s.kv_tokens else s.kv
            x = (((seats if seats > kv else kv) / s.speed) * (1.0 + jitter * (((s.spin ^ spin) * 0x2545) & 0xFFFF)),
                 wid, s)
            scored.append(x)
            if wid == home_id:
                home = x
            elif wid == second_id:
                second = x
        if facts.adapter:
            return self._rank_adapter(scored, facts, limit)
        key = facts.affinity_key
        if key is None or len(candidates) == 1:
            return [Choice(x[2], "least-load") for x in best(scored, limit)]
        kind = facts.affinity_kind or "prefix"
        if home is None:
            pick, reason = self._place(key, scored, facts, live, routes), f"{kind}-placed"
        elif second is not None:
            # A second home while the first was saturated: the two share the key by load.
            pick, reason = (home, f"{kind}-hit") if home[0] <= second[0] else (second, f"{kind}-spill")
        elif not self.saturated(home[2], live):
            pick, reason = home, f"{kind}-hit"
        elif facts.heavy:
            # A hot key saturating its home: a worker with room, clearly less loaded, shares it.
            bar = home[0] * (1.0 - opts.spill_margin)
            room = [x for x in scored if x[1] != home[1] and x[0] < bar and not self.saturated(x[2], live)]
            pick, reason = (min(room), f"{kind}-spill") if room else (home, f"{kind}-hit")
        else:
            # A light key stays where its prefix is cached even on a saturated home; the
            # engine queues it, and the background rebalance moves light keys off a worker
            # whose placed work is above its share.
            pick, reason = home, f"{kind}-hit"
        if limit == 1:
            return [Choice(pick[2], reason)]
        rest = best([x for x in scored if x[1] != pick[1]], limit - 1)
        return [Choice(pick[2], reason), *(Choice(x[2], "least-load") for x in rest)]

    def _place(
        self, key: int, scored: list[tuple[float, str, Slot]], facts: RequestFacts, live: Live,
        routes: ModelRoutes,
    ) -> tuple[float, str, Slot]:
        """A new key's home: where its work (this request's, as a first guess) leaves the least
        placed work per unit of capacity, among workers whose cache has room for its prefix
        beside the keys already placed there and that are not saturated; ties go in the
        key's ring order, so replicas agree."""
        homes = live.homes
        by_id = {x[1]: x for x in scored}
        need = facts.prefix_tokens
        work = max(1, facts.prompt_tokens - need) + min(facts.max_tokens or 256, 256)  # as Attempt.work
        # Without a placement table (a bare decision), the key's ring order alone decides.
        costs = homes.placement_costs([x[2] for x in scored], work, need) if homes is not None else {}
        chosen: tuple[float, str, Slot] | None = None
        chosen_cost = 0.0
        for s in routes.ring_order(key):
            x = by_id.get(s.id)
            if x is None:
                continue
            cost = costs.get(s.id, 0.0)
            if homes is not None and s.kv_tokens and homes.prefixes.get(s.id, 0) + need > s.kv_tokens * self.opts.kv_high:
                cost += 1e6  # its cache cannot hold another prefix beside its keys'
            if self.saturated(s, live):
                cost += 1e12
            if chosen is None or cost < chosen_cost * (1 - 1e-9) - 1e-12:
                chosen, chosen_cost = x, cost
        return chosen if chosen is not None else min(scored)

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
