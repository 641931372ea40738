"""LoRA placement state that every gateway replica shares: adapter requests in flight per
(worker, adapter), and when each adapter was last sent to each worker (the LRU evictions
follow); and what routing reads of it (`residency`): where an adapter is live, and where
every LoRA slot is taken by others.

The request path only touches local dicts (`started`, `finished`); a background task
publishes them about five times a second, and at once when an adapter comes into use on
a worker (the counts under a lease, like gateway/accounts/inflight.py's, so a crashed gateway leaks
nothing), and reads the other replicas'; a gateway about to evict reads them afresh.
An adapter is evictable from a worker only when no gateway has a request for it there.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from fleetgate.background import Outage, repeat, stop_tasks
from fleetgate.registry import Registry
from gateway.routing.lora_gate import Gate, SlotView, gate
from gateway.routing.table import Slot

log = structlog.get_logger("gateway.lora_state")

# An engine reporting this share of its KV cache in use is overloaded (as FleetOptions.kv_high).
_KV_FULL = 0.9


class LoraState:
    def __init__(self, registry: Registry, gateway_id: str, interval_s: float = 0.2,
                 lease_s: float = 3.0) -> None:
        self.registry = registry
        self.gateway_id = gateway_id
        self.interval_s = interval_s
        self.lease_s = lease_s
        self.local: dict[tuple[str, str], int] = {}
        self.remote: dict[tuple[str, str], int] = {}
        # Unix times: comparable with the other replicas' through Redis.
        self.used: dict[tuple[str, str], float] = {}
        self._unpublished: dict[tuple[str, str], float] = {}
        self._remote_at = 0.0
        # Unix time it began watching: until `recent_s` later it cannot tell which adapters
        # are in demand (fleet_spare).
        self.watching_since = time.time()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # This gateway's side of the slot gate (gateway/routing/lora_gate.py), in monotonic s:
        # when each adapter's current turn on a worker began (it came into use there), and
        # when each request held for a slot there arrived.
        self.turns: dict[tuple[str, str], float] = {}
        self.held: dict[tuple[str, str], list[float]] = {}
        # (adapter, why) -> requests held for a slot; adapter -> held ones sent at their limit.
        self.slot_holds: dict[tuple[str, str], int] = {}
        self.slot_hold_timeouts: dict[str, int] = {}

    # -- the request path ----------------------------------------------------------

    def started(self, worker_id: str, adapter: str) -> None:
        key = (worker_id, adapter)
        n = self.local.get(key, 0)
        self.local[key] = n + 1
        self.touch(worker_id, adapter)
        if n == 0:  # an adapter newly in use there: its turn begins, the other replicas hear of it at once
            self.turns.setdefault(key, time.monotonic())
            self._wake.set()

    def finished(self, worker_id: str, adapter: str) -> None:
        key = (worker_id, adapter)
        left = self.local.get(key, 1) - 1
        if left > 0:
            self.local[key] = left
        else:
            self.local.pop(key, None)
            self.turns.pop(key, None)  # its turn there ends with its last request
        self.touch(worker_id, adapter)  # in use until it finished: recent by the LRU

    def touch(self, worker_id: str, adapter: str) -> None:
        now = time.time()
        self.used[(worker_id, adapter)] = now
        self._unpublished[(worker_id, adapter)] = now

    def in_flight(self, worker_id: str, adapter: str) -> int:
        """Requests for `adapter` on `worker_id` in flight through any gateway."""
        key = (worker_id, adapter)
        return self.local.get(key, 0) + self.remote.get(key, 0)

    def last_used(self, worker_id: str, adapter: str) -> float:
        return self.used.get((worker_id, adapter), 0.0)

    def live(self) -> dict[str, set[str]]:
        """Worker -> the adapters with requests in flight there through any gateway."""
        out: dict[str, set[str]] = {}
        for counts in (self.local, self.remote):
            for (worker, adapter), n in counts.items():
                if n > 0:
                    out.setdefault(worker, set()).add(adapter)
        return out

    # -- the slot gate ---------------------------------------------------------------

    def slot_view(self, slot: Slot) -> SlotView:
        """`slot`'s engine as the slot gate reads it: its slots, its live adapters, when this
        gateway's turns there began, and the requests held here for a slot there."""
        limit = 0 if slot.adapters_fit else slot.max_loras
        if not limit:
            return SlotView(0, frozenset())
        wid = slot.id
        busy: dict[str, int] = {}
        for (w, a), n in (*self.local.items(), *self.remote.items()):
            if w == wid and n > 0:
                busy[a] = busy.get(a, 0) + n
        return SlotView(limit, frozenset(live_adapters(slot, busy, self.last_used)),
                        {a: at for (w, a), at in self.turns.items() if w == wid},
                        {a: min(ats) for (w, a), ats in self.held.items() if w == wid and ats}, busy)

    def held_on(self, adapter: str) -> str:
        """A worker where requests for `adapter` are held here for a slot ("" when none)."""
        return next((w for (w, a), ats in self.held.items() if a == adapter and ats), "")

    def gate(self, slot: Slot, adapter: str, arrived: float, turn_s: float) -> Gate | None:
        """Whether a request for `adapter` (arrived at `arrived`, monotonic) waits here for a
        slot on `slot`'s engine ("slot", "turn"), or goes (None)."""
        return gate(self.slot_view(slot), adapter, arrived, time.monotonic(), turn_s)

    def hold(self, worker_id: str, adapter: str, arrived: float, why: str) -> None:
        self.held.setdefault((worker_id, adapter), []).append(arrived)
        key = (adapter, why)
        self.slot_holds[key] = self.slot_holds.get(key, 0) + 1

    def unhold(self, worker_id: str, adapter: str, arrived: float, timed_out: bool) -> None:
        key = (worker_id, adapter)
        ats = self.held.get(key)
        if ats is not None:
            ats.remove(arrived)
            if not ats:
                del self.held[key]
        if timed_out:
            self.slot_hold_timeouts[adapter] = self.slot_hold_timeouts.get(adapter, 0) + 1

    # -- background sync --------------------------------------------------------------

    def start(self, workers: Callable[[], list[str]]) -> None:
        self._task = asyncio.create_task(self._loop(workers), name="lora-state-sync")

    async def stop(self) -> None:
        await stop_tasks(self._task)

    async def sync(self, worker_ids: list[str]) -> None:
        unpublished, self._unpublished = self._unpublished, {}
        try:
            await self.registry.publish_lora(self.gateway_id, self.local, unpublished, self.lease_s)
        except BaseException:
            for key, at in unpublished.items():  # sent with the next sync
                self._unpublished.setdefault(key, at)
            raise
        await self.refresh_remote()
        for key, at in (await self.registry.read_lora_used(worker_ids)).items():
            if at > self.used.get(key, 0.0):
                self.used[key] = at

    async def refresh_remote(self) -> None:
        """Read the other replicas' in-flight counts now (before an eviction, say)."""
        remote = await self.registry.read_lora(exclude_gateway=self.gateway_id)
        self.remote.clear()
        self.remote.update(remote)
        self._remote_at = time.monotonic()

    async def _loop(self, workers: Callable[[], list[str]]) -> None:
        outage = Outage(log, "gateway.lora_state_sync_failed", "gateway.lora_state_sync_resumed")
        await repeat(lambda: self.sync(workers()), outage, self.interval_s, on_error=self._expire_remote,
                     wake=self._wake)

    def _expire_remote(self) -> None:
        if time.monotonic() - self._remote_at > self.lease_s:
            self.remote.clear()  # the other replicas' counts expire with their lease


def still_reported(worker_id: str, active: Iterable[str], reported: float,
                   last_used: Callable[[str, str], float]) -> set[str]:
    """Of the adapters an engine's report (at `reported`, Unix time) names as running, those no
    gateway sent or finished there since the report (another client's, or still the truth); an
    adapter a gateway finished with after the report is gone, whatever the report says."""
    return {a for a in active if last_used(worker_id, a) < reported}


def live_adapters(slot: Slot, sent: Iterable[str], last_used: Callable[[str, str], float]) -> set[str]:
    """The adapters with requests on `slot`'s engine now: those the gateways have in flight
    there (`sent`), and those its last report still names (`still_reported`)."""
    return set(sent) | still_reported(slot.id, slot.lora_active, slot.lora_ts, last_used)


def residency(
    slots: Iterable[Slot], model: str, state: LoraState, now: float, recent_s: float = 30.0,
    hold_s: float = 10.0, heavy_share: float = 0.3,
) -> tuple[frozenset[str], frozenset[str]]:
    """(warm, full) for a request for adapter `model` over the workers serving it.

    warm: where the adapter is live (requests in flight there, by the gateways or the engine's
    report); where it is live nowhere, the worker it was last sent to within `recent_s` while
    that one has a slot for it (its weights and its prefix cache are likely still there).
    full: where sending it would make the engine's distinct adapters exceed its slots (every
    slot live with another adapter), and where it is live on an engine that already has more
    adapters than slots (it may be among the waiting). A slot whose adapter ran there within
    `hold_s` stays held for it while idle: an engine whose free slots are all held counts as
    full too, unless the adapter needs a slot (it is live nowhere, or only where it is
    crowded) and no engine has one free and unheld (then idle adapters make room). Of the
    engines with free slots, only those with the most count as not full: new adapters spread
    over the fleet's slots, leaving each engine room for a passing extra one.

    The fleet's slots are one budget (`fleet_spare`): the adapters live on each engine, and
    those that ran within `recent_s` and are live nowhere now (they come back, and need a
    slot), against the slots of all the engines. An adapter live where it has room takes
    another engine only when the budget has a slot to spare beyond all of those: otherwise
    every other engine is full for it (a second copy of a hot adapter would leave a cold one
    without a slot, waiting), unless its engines report themselves overloaded (`_overloaded`:
    they queue it anyway). An adapter live on several engines while the budget is short goes
    to one of them (`_primary`) unless that one is overloaded: the others' copies drain and
    give their slots back.
    Only a heavy adapter (`heavy_share` of the requests in flight where it is live with room,
    as FleetOptions.heavy_share for an affinity key) takes another engine: moving a light one's
    few requests relieves its engine of little, and the copy costs a slot and the prefix cache
    its system prompts take there (vLLM keys cached blocks by adapter), so every engine where it
    is not live is full for it, unless its engines report themselves overloaded.
    A worker with unknown slots, or whose adapters all fit its slots, is never full.
    """
    slots = list(slots)
    live_by = state.live()
    lives = {slot.id: live_adapters(slot, live_by.get(slot.id, ()), state.last_used) for slot in slots}
    survey = _Survey.of(slots, lives, _ran_since(state, now - hold_s), model, state.last_used, now - recent_s)
    survey.hand_out_held_slots()
    survey.warm_again_where_it_last_ran()
    survey.spread_over_the_roomiest()
    survey.keep_within_the_fleets_slots(slots, fleet_spare(slots, lives, state, now, recent_s), model, state)
    survey.copy_only_the_heavy(slots, model, state, heavy_share)
    return frozenset(survey.warm), frozenset(survey.full)


def _ran_since(state: LoraState, since: float) -> dict[str, set[str]]:
    """Worker -> the adapters sent there since `since` (each holds a slot there while idle)."""
    ran: dict[str, set[str]] = {}
    for (w, a), at in state.used.items():
        if at >= since:
            ran.setdefault(w, set()).add(a)
    return ran


@dataclass(slots=True)
class _Survey:
    """`residency`'s workings for one adapter: each engine serving it, sorted by what it has
    for it (`of`), then the fleet-wide rules applied one by one."""

    warm: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)
    crowded: list[str] = field(default_factory=list)  # warm, and its engine has more adapters than slots
    held_only: list[str] = field(default_factory=list)  # a free slot only by taking one an idle adapter holds
    room: dict[str, float] = field(default_factory=dict)  # free slots that no idle adapter holds (inf: unknown)
    recent: list[tuple[float, str]] = field(default_factory=list)  # (when it last ran there, worker)

    @classmethod
    def of(cls, slots: Sequence[Slot], lives: Mapping[str, set[str]], ran: Mapping[str, set[str]], model: str,
           last_used: Callable[[str, str], float], recent: float) -> _Survey:
        survey = cls()
        for slot in slots:
            wid = slot.id
            live = lives[wid]
            limit = 0 if slot.adapters_fit else slot.max_loras
            if model in live:
                survey.warm.append(wid)
                if limit and len(live) > limit:
                    survey.full.append(wid)
                    survey.crowded.append(wid)
            elif limit and len(live) >= limit:
                survey.full.append(wid)
            else:
                survey._idle_there(wid, live, ran.get(wid, set()), limit, model, last_used(wid, model), recent)
        return survey

    def _idle_there(self, wid: str, live: set[str], ran: set[str], limit: int, model: str, last: float,
                    recent: float) -> None:
        """An engine with a slot for the adapter, which is not live there."""
        # The adapter's own hold there is its own slot.
        free = limit - len((live | ran) - {model}) if limit else math.inf
        if free > 0:
            self.room[wid] = free
        else:
            self.held_only.append(wid)
        if last >= recent:
            self.recent.append((last, wid))

    def hand_out_held_slots(self) -> None:
        """Held slots go to an adapter that needs one (live nowhere, or only where it is crowded)
        when no engine has a free unheld one; never to a hot adapter's extra engine."""
        if self.room or any(w not in self.full for w in self.warm):
            self.full.extend(self.held_only)

    def warm_again_where_it_last_ran(self) -> None:
        """Live nowhere: warm where it ran last within `recent_s`, if that engine has a slot."""
        if not self.warm:
            back = [x for x in self.recent if x[1] not in self.full]
            if back:
                self.warm.append(max(back)[1])

    def spread_over_the_roomiest(self) -> None:
        """Of the engines with free slots, only those with the most are not full."""
        if self.room:
            most = max(self.room.values())
            self.full.extend(w for w, free in self.room.items() if free < most and w not in self.warm)

    def keep_within_the_fleets_slots(self, slots: Sequence[Slot], spare: float, model: str,
                                     state: LoraState) -> None:
        """The fleet's slot budget (`fleet_spare`): no second engine for an adapter live with
        room unless a slot is spare, and one engine for an adapter live on several when short."""
        by_id = {s.id: s for s in slots}
        homes = [w for w in self.warm if w not in self.full]
        if spare < 1 and homes and not all(_overloaded(by_id[w]) for w in homes):
            # Live with room: another engine only with a slot to spare in the whole fleet.
            self.full.extend(s.id for s in slots if s.id not in self.warm)
        if spare < 0 and len(self.warm) > 1:
            keep = _primary(self.warm, self.crowded, model, state)
            if not _overloaded(by_id[keep]):
                self.full.extend(w for w in self.warm if w != keep)
                self.warm = [keep]

    def copy_only_the_heavy(self, slots: Sequence[Slot], model: str, state: LoraState, heavy_share: float) -> None:
        """Live with room and light there (under `heavy_share` of the requests in flight on its
        engines): no other engine, unless they report themselves overloaded."""
        by_id = {s.id: s for s in slots}
        homes = [w for w in self.warm if w not in self.full]
        if not homes or all(_overloaded(by_id[w]) for w in homes):
            return
        mine = sum(state.in_flight(w, model) for w in homes)
        if not mine:  # warm only where it last ran: its first request back goes as before
            return
        there = set(homes)
        total = sum(n for counts in (state.local, state.remote) for (w, _), n in counts.items() if w in there)
        if mine < heavy_share * total:
            self.full.extend(s.id for s in slots if s.id not in self.warm and s.id not in self.full)


def fleet_spare(
    slots: Sequence[Slot], lives: Mapping[str, set[str]], state: LoraState, now: float, recent_s: float = 30.0,
) -> float:
    """The fleet's LoRA slots left over: the engines' slots, less the adapters live on each and
    the adapters that ran on one of them within `recent_s` and are live nowhere now (they are
    still in demand); before the gateway has watched for `recent_s` it cannot tell which are
    in demand, so it counts every adapter the engines serve (infinite where an engine's
    slots are unknown or hold all its adapters: no budget to keep)."""
    total = 0
    placed = 0
    live_anywhere: set[str] = set()
    for slot in slots:
        if slot.adapters_fit or not slot.max_loras:
            return math.inf
        total += slot.max_loras
        live = lives.get(slot.id, set())
        placed += len(live)
        live_anywhere |= live
    ids = {slot.id for slot in slots}
    if now - state.watching_since < recent_s:
        wanted = {a for slot in slots for a in slot.view.info.adapters}
    else:
        cut = now - recent_s
        wanted = {a for (w, a), at in state.used.items() if at >= cut and w in ids}
    return total - placed - len(wanted - live_anywhere)


def _overloaded(slot: Slot) -> bool:
    """Its last report shows it at its sequence slots or its KV cache nearly full: a hot adapter
    there is worth a second engine even at the cost of a slot wait (the engine queues anyway)."""
    return slot.running >= slot.capacity or slot.kv >= _KV_FULL


def _primary(warm: Sequence[str], crowded: Sequence[str], model: str, state: LoraState) -> str:
    """Where an adapter live on several engines stays while the fleet is short of slots: one
    with room for it if any, then where it has the most requests in flight (the other copies
    drain first), then the smallest id, so replicas agree."""
    return min(warm, key=lambda w: (w in crowded, -state.in_flight(w, model), w))


def slot_wait(slot: Slot, model: str, state: LoraState) -> int:
    """How many adapters hold every slot of `slot`'s engine when a request for `model` goes
    there and it is live there with none of them (the request waits for a slot); 0 when it
    is live there, a slot is free, or the slots are unknown."""
    limit = 0 if slot.adapters_fit else slot.max_loras
    if not limit:
        return 0
    sent = [a for (w, a), n in (*state.local.items(), *state.remote.items()) if w == slot.id and n > 0]
    live = live_adapters(slot, sent, state.last_used)
    return len(live) if model not in live and len(live) >= limit else 0


__all__ = ["LoraState", "fleet_spare", "live_adapters", "residency", "slot_wait", "still_reported"]
