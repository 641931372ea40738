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
3. Adapters: an engine runs at most its LoRA slots' worth of distinct adapters in a batch and
   lets a request whose adapter finds every slot busy wait, with no fairness (vLLM), so each
   engine is given a set of adapters whose live requests fit its slots. A request goes where
   its adapter is live (the gateways' requests in flight, the engines' own reports); a hot
   one gets another engine with a free slot when its own is `lora_load_cost` busier (or
   saturated), and only while the fleet's slots have one to spare beyond every adapter in
   demand (else a cold adapter would come back to no slot); an adapter live on several
   engines while the fleet is short of slots goes to one of them, so the other copies drain.
   Live on several, its requests go to its primary (the first of them in its ring order), and
   to the least loaded other copy only while the primary is half `lora_load_cost` busier (or
   saturated): made at the whole cost, kept at half (hysteresis), a copy drains once the burst
   that made it is over, giving back its slot and the prefix cache its system prompts took
   (vLLM keys cached blocks by adapter).
   An adapter live nowhere goes back where it last ran while a slot is free there, else to an
   engine with a free slot; only when none has one, to an engine whose slots are all live
   with others (a slot wait, counted by the placer), the one with the fewest adapters in
   demand by its report; there the gateway's slot gate holds it until a slot turns over
   (gateway/routing/lora_gate.py), rather than let the engine starve it. The facts (`warm`, `full`) come from
   gateway/accounts/lora_state.py `residency`. Among equals (within a small band of load) the
   adapter's ring order decides, so replicas choose alike.
4. What the engines cache: where workers publish their KV cache events and the gateway
   knows the prompt's token ids (`facts.cached`, gateway/request/prefix_cache.py), the engines'
   figure corrects the placement. A worker holding clearly more of the prompt than the
   key's home (it saves `kv_gain` of what the home would compute again) and not saturated
   takes the request ("kv-hit"; "kv-placed" for a key not placed yet, which is placed
   there): the home evicted the prefix or restarted, the conversation's earlier turns went
   elsewhere, another client or gateway replica warmed it. Where the home holds as much,
   or nothing is known, the placement decides as above. Then the queue: where another
   worker's first token would come clearly sooner, by the prefill queued on each (the
   streams sent whose first token has not come, what their engines did not hold of them)
   plus what each would prefill of this prompt, it takes the request ("kv-sooner"): a turn
   kept home waits behind that home's prefills while another engine computes its prompt
   sooner (engines queue on prefill with their caches half empty), where its cache has room
   for what it would add, and, for a request that is mostly its key's shared prefix (a
   tenant's system prompt and a question), where that prefix is held already: the rule
   moves conversations, it never copies a tenant's system prompt (that spreads the tenant).
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
            return self._rank_adapter(scored, facts, live, routes, limit)
        key = facts.affinity_key
        cached = facts.cached
        if len(candidates) == 1 or (key is None and not cached):
            return [Choice(x[2], "least-load") for x in best(scored, limit)]
        if cached and (held := self._holder(scored, facts, live, home, second)) is not None:
            pick, reason = held, "kv-placed" if key is not None and home is None else "kv-hit"
        elif key is None:
            pick, reason = min(scored), "least-load"
        else:
            pick, reason = self._by_home(key, facts.affinity_kind or "prefix", scored, facts, live, routes, home,
                                         second)
        if cached and self.opts.prefill_margin and (sooner := self._sooner(pick, scored, facts, live)) is not None:
            # A key not placed yet is placed where its first request goes.
            pick, reason = sooner, reason if reason.endswith("-placed") else "kv-sooner"
        return _with_rest(pick, reason, scored, limit)

    def _by_home(
        self, key: int, kind: str, scored: list[tuple[float, str, Slot]], facts: RequestFacts, live: Live,
        routes: ModelRoutes, home: tuple[float, str, Slot] | None, second: tuple[float, str, Slot] | None,
    ) -> tuple[tuple[float, str, Slot], str]:
        """The pick for a request with an affinity key, by its homes, and why."""
        if home is None:
            return self._place(key, scored, facts, live, routes), f"{kind}-placed"
        if second is not None:
            # A second home while the first was saturated: the two share the key by load.
            return (home, f"{kind}-hit") if home[0] <= second[0] else (second, f"{kind}-spill")
        if not self.saturated(home[2], live):
            return home, f"{kind}-hit"
        if facts.heavy:
            # A hot key saturating its home: a worker with room, clearly less loaded, shares it.
            bar = home[0] * (1.0 - self.opts.spill_margin)
            room = [x for x in scored if x[1] != home[1] and x[0] < bar and not self.saturated(x[2], live)]
            return (min(room), f"{kind}-spill") if room else (home, f"{kind}-hit")
        # A light key stays where its prefix is cached even on a saturated home; the engine
        # queues it, and the background rebalance moves light keys off a worker whose placed
        # work is above its share.
        return home, f"{kind}-hit"

    def _holder(
        self, scored: list[tuple[float, str, Slot]], facts: RequestFacts, live: Live,
        home: tuple[float, str, Slot] | None, second: tuple[float, str, Slot] | None,
    ) -> tuple[float, str, Slot] | None:
        """The worker whose engine holds clearly more of the prompt than the home logic's
        choice would, by its KV cache events, and has room; None: the home logic decides.

        Clearly more: it saves `kv_gain` of what that choice would compute again. The home
        lost the prefix (evicted, restarted) or never had it (the conversation's turns went
        elsewhere, another client or replica warmed it); of a key's two homes, which the home
        logic shares by load, one holds the conversation and the other only the shared
        prefix. Among such workers, those within that margin of the most held, the least
        loaded."""
        held = facts.cached
        if home is None:
            known = 0
        elif second is None:
            known = held.get(home[1], 0)
        else:  # the home logic may choose either
            known = min(held.get(home[1], 0), held.get(second[1], 0))
        margin = max(1.0, self.opts.kv_gain * (facts.prompt_tokens - known))
        holders = [x for x in scored if held.get(x[1], 0) >= known + margin and not self.saturated(x[2], live)]
        if not holders:
            return None
        most = max(held[x[1]] for x in holders)
        return min(x for x in holders if held[x[1]] >= most - margin)

    def _sooner(
        self, pick: tuple[float, str, Slot], scored: list[tuple[float, str, Slot]], facts: RequestFacts, live: Live,
    ) -> tuple[float, str, Slot] | None:
        """The worker, not saturated, where the request's first token comes clearly sooner than
        on `pick` by the prefill ahead of it: the prompt tokens queued there (`Live.pending`)
        plus those of this prompt its engine does not hold, per unit of speed; None: `pick`.
        Clearly: by `prefill_margin` of the prompt. Only workers whose holdings are known, that
        hold the prefix the key shares already where that is most of the prompt, and whose KV
        cache keeps room (`sooner_kv_max`) for what they would add of the prompt."""
        held = facts.cached
        if pick[1] not in held:
            return None
        pending = live.pending.get
        prompt = facts.prompt_tokens
        s = pick[2]
        found_at = (pending(pick[1], 0) + prompt - held[pick[1]] - self.opts.prefill_margin * prompt) / s.speed
        found = None
        room = self.opts.sooner_kv_max
        # A request that is mostly the prefix its key's requests share (a tenant's system prompt
        # and a question) goes only where that prefix is held already: a copy would spread the
        # tenant over the fleet's caches, the placement's call (it doubles what the key holds).
        # One that is mostly its own (a conversation's turns) may take the prefix along.
        # 0.8: the slack of an estimated prefix.
        shared = 0.8 * facts.prefix_tokens if 2 * facts.prefix_tokens > prompt else 0.0
        for x in scored:
            wid = x[1]
            if wid == pick[1] or wid not in held or held[wid] < shared:
                continue
            own = prompt - held[wid]
            ahead = (pending(wid, 0) + own) / x[2].speed
            if ahead < found_at and not self.saturated(x[2], live) and (
                not x[2].kv_tokens or kv_in_use(x[2], live) + own <= room * x[2].kv_tokens
            ):
                found, found_at = x, ahead
        return found

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
        self, scored: list[tuple[float, str, Slot]], facts: RequestFacts, live: Live, routes: ModelRoutes,
        limit: int,
    ) -> list[Choice]:
        """Place an adapter request by the engines' LoRA slots (facts.warm: where the adapter is
        live, facts.full: where it would wait for a slot; gateway/accounts/lora_state.py)."""
        warm, full = facts.warm, facts.full
        groups: tuple[list[tuple[float, str, Slot]], ...] = ([], [], [], [])
        # Without the per-request jitter: replicas with other request counters must agree.
        jitter = self.opts.jitter * _JITTER_SCALE
        spin = (facts.seq * 0x9E3779B1) & 0xFFFF
        for cost, wid, s in scored:
            x = (cost / (1.0 + jitter * (((s.spin ^ spin) * 0x2545) & 0xFFFF)), wid, s)
            if s.adapters_fit or (wid in warm and wid not in full):
                groups[_LIVE].append(x)
            elif wid not in full:
                groups[_FREE].append(x)
            elif wid in warm:
                groups[_CROWDED].append(x)
            else:
                groups[_SLOT_WAIT].append(x)
        rank = _ring_rank(routes, facts.affinity_key)
        home = self._band_pick(groups[_LIVE], rank)
        spare = self._band_pick(groups[_FREE], rank)
        if home is not None and spare is not None and self._busier(home, spare, self.opts.lora_load_cost, live):
            pick, reason = spare, "adapter-spill"  # a hot adapter's home is overloaded: another engine
        elif home is not None:
            # Where its adapters all fit an engine's slots, it is "live" there unsent: load decides.
            pick, reason = self._copy_pick(groups[_LIVE], rank, live) if all(
                x[1] in warm for x in groups[_LIVE]) else (home, "adapter-warm")
        elif spare is not None:
            pick, reason = spare, "adapter-free"
        elif crowded := self._band_pick(groups[_CROWDED], rank):
            pick, reason = crowded, "adapter-crowded"
        else:
            pick, reason = self._wait_pick(groups[_SLOT_WAIT], rank) or min(scored), "adapter-slot-wait"
        if limit == 1:
            return [Choice(pick[2], reason)]
        rest = [(g, x[0], x[1], x[2]) for g, group in enumerate(groups) for x in group if x[1] != pick[1]]
        return [Choice(pick[2], reason), *(Choice(x[3], _REASONS[x[0]]) for x in best(rest, limit - 1))]

    def _copy_pick(
        self, group: list[tuple[float, str, Slot]], rank: Mapping[str, int], live: Live,
    ) -> tuple[tuple[float, str, Slot], str]:
        """Of the engines where the adapter is live, the one its requests go to, and why: its
        primary (the first of them in the adapter's ring order) unless that is busier than the
        least loaded other copy by half `lora_load_cost` (or saturated, the copy not), which then
        shares the load ("adapter-share"). A copy is made only at the whole cost (the spill) and
        kept only while the primary stays busier by half of it (hysteresis); below that every
        request goes to the primary, so the copies drain and give back their slots and the
        prefix cache their adapter's system prompts took there."""
        primary = min(group, key=lambda x: (rank.get(x[1], len(rank)), x[1]))
        if len(group) > 1:
            copy = self._band_pick([x for x in group if x is not primary], rank)
            if copy is not None and self._busier(primary, copy, self.opts.lora_load_cost * _KEEP, live):
                return copy, "adapter-share"
        return primary, "adapter-warm"

    def _busier(
        self, there: tuple[float, str, Slot], other: tuple[float, str, Slot], margin: float, live: Live,
    ) -> bool:
        """`there` is busier than `other` by `margin` (seats per unit of capacity), or saturated
        where `other` is not: an adapter's requests are worth taking elsewhere."""
        return other[0] + margin < there[0] or (self.saturated(there[2], live) and not self.saturated(other[2], live))

    def _wait_pick(
        self, group: list[tuple[float, str, Slot]], rank: Mapping[str, int],
    ) -> tuple[float, str, Slot] | None:
        """Where an adapter waits for a slot: among the engines with the fewest adapters in demand
        by their reports (the fewest ahead of it for a slot, and it keeps the adapters spread
        evenly over the engines' slots), the least loaded band, then ring order."""
        if len(group) < 2:
            return group[0] if group else None
        fewest = min(len(x[2].lora_active) for x in group)
        return self._band_pick([x for x in group if len(x[2].lora_active) == fewest], rank)

    def _band_pick(
        self, group: list[tuple[float, str, Slot]], rank: Mapping[str, int],
    ) -> tuple[float, str, Slot] | None:
        """The first in ring order among the least loaded (within a small margin): replicas that
        see the same loads choose the same engine, and near-equal engines share by ring order."""
        if not group:
            return None
        if len(group) == 1:
            return group[0]
        bar = min(group)[0] * (1.0 + _BAND) + _BAND
        return min((x for x in group if x[0] <= bar), key=lambda x: (rank.get(x[1], len(rank)), x[1]))


def _with_rest(
    pick: tuple[float, str, Slot], reason: str, scored: list[tuple[float, str, Slot]], limit: int,
) -> list[Choice]:
    """`pick` first, then the least loaded of the rest up to `limit`."""
    if limit == 1:
        return [Choice(pick[2], reason)]
    rest = best([x for x in scored if x[1] != pick[1]], limit - 1)
    return [Choice(pick[2], reason), *(Choice(x[2], "least-load") for x in rest)]


# An adapter request's worker groups, in the order they are tried.
_LIVE, _FREE, _CROWDED, _SLOT_WAIT = 0, 1, 2, 3
_REASONS = ("adapter-warm", "adapter-free", "adapter-crowded", "adapter-slot-wait")
# An adapter's extra copy keeps sharing its load only while its primary is busier by this share
# of `lora_load_cost` (what it took to make the copy); below, the copy drains.
_KEEP = 0.5
# Loads this close (2%, and 0.02 seats per unit of capacity) count as equal for an adapter's
# placement.
_BAND = 0.02


def _ring_rank(routes: ModelRoutes, key: int | None) -> dict[str, int]:
    """Worker -> its place in the key's ring order (by id without a key)."""
    if key is None:
        return {s.id: i for i, s in enumerate(routes.slots)}
    return {s.id: i for i, s in enumerate(routes.ring_order(key))}
