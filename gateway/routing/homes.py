"""Where each affinity key lives: the placement table the fleet policy reads and the gateway writes.

A consistent-hash ring gives each key a home by hash alone: with a handful of heavy keys
(16 tenants on two workers) the split came out 10/6, and a bounded-load rule that sent a
request away from its home whenever the home looked busy (on a second-old queue gauge)
put every tenant on every worker under KV pressure, so both prefix caches thrashed.

Here a key keeps the worker it was placed on. A new key goes to the worker with the least
work already placed there per unit of capacity (ties broken in the key's ring order, so
replicas that have seen the same traffic agree), which partitions the working set the way
a client that knows its tenants would. `rebalance` (called in the background, about once
a second) moves one light key off a worker whose placed work is well above its share:
hysteresis against oscillation, and a hot tenant is not moved (a cold one is). A key gets
a second home only while its home is saturated by the gateway's own account, and keeps it
for `second_hold_s` after the last time that happened.

Work is decayed with a half-life, so placement follows the traffic of the last minute or
so; a key's prefix counts in its home's cache while the key does a request's work, and
fades with it after (`KeyHome.cached`). A unit of work holds KV in flight 1/speed as long on
a slower card. No I/O and no clock: callers pass `now`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gateway.routing.table import ModelRoutes, Slot


@dataclass(slots=True)
class KeyHome:
    home: str
    model: str
    # Tokens of the shared prefix (a system prompt): what the home's cache holds for it.
    prefix_tokens: int
    # The largest prompt + completion seen for the key: a new home must fit it.
    need: int
    # Work routed for this key (tokens, decayed to `at`).
    work: float = 0.0
    at: float = 0.0
    second: str | None = None
    second_until: float = 0.0
    # The work of the key's first request: one request's worth.
    unit: float = 0.0

    def live_second(self, now: float) -> str | None:
        return self.second if self.second is not None and now < self.second_until else None

    def cached(self) -> float:
        """Prefix tokens its home's cache is taken to hold for it: all of them while the key
        has done at least one request's work lately, then less as that work decays (the engine
        evicts a prefix nobody uses: a one-off key, a conversation's first message, must not
        weigh on its home's cache for the many half-lives until the key is dropped)."""
        unit = self.unit
        if unit <= 0 or self.work >= unit:
            return float(self.prefix_tokens)
        return self.prefix_tokens * self.work / unit


@dataclass(slots=True)
class Homes:
    half_life_s: float = 30.0
    second_hold_s: float = 10.0
    # A worker's placed work per unit of capacity this far above the mean moves a key.
    imbalance: float = 0.2
    max_keys: int = 100_000
    keys: dict[int, KeyHome] = field(default_factory=dict)
    # Worker -> decayed work of the keys homed there (recomputed by `rebalance`, grown by `note`).
    placed: dict[str, float] = field(default_factory=dict)
    # Worker -> prefix tokens of the keys homed there (what its cache must hold for them; a
    # key's share fades with its work below one request's, `KeyHome.cached`).
    prefixes: dict[str, float] = field(default_factory=dict)
    # Worker -> KV tokens its requests in flight held, by the gateway's account, averaged
    # over the last few passes: what a worker's cache must really hold besides its prefixes.
    kv_avg: dict[str, float] = field(default_factory=dict)
    # Worker -> its speed (reference-card sequences per sequence slot), as `rebalance` last
    # saw it: a request lives 1/speed as long on it, so its work holds KV 1/speed as long.
    speeds: dict[str, float] = field(default_factory=dict)
    moves: int = 0

    def get(self, key: int) -> KeyHome | None:
        return self.keys.get(key)

    def heavy(self, entry: KeyHome, share: float) -> bool:
        """The key does at least `share` of the work placed on its home."""
        return entry.work >= share * self.placed.get(entry.home, 0.0) > 0

    # -- writes, from the gateway after each decision ----------------------------------

    def place(self, key: int, worker: str, model: str, prefix_tokens: int, need: int, now: float) -> KeyHome:
        if len(self.keys) >= self.max_keys:
            self._evict_coldest(now)
        entry = KeyHome(worker, model, prefix_tokens, need, at=now)
        self.keys[key] = entry
        self.prefixes[worker] = self.prefixes.get(worker, 0.0) + prefix_tokens
        return entry

    def note(self, key: int, worker: str, work: float, need: int, now: float) -> None:
        """A request of `key` went to `worker` and costs `work` tokens."""
        entry = self.keys.get(key)
        if entry is None:
            return
        if entry.unit <= 0:
            entry.unit = work
        entry.work = self._decayed(entry, now) + work
        entry.at = now
        entry.need = max(entry.need, need)
        self.placed[worker] = self.placed.get(worker, 0.0) + work

    def spill(self, key: int, worker: str, now: float) -> None:
        """`key`'s home was saturated: `worker` is its second home for a while."""
        entry = self.keys.get(key)
        if entry is not None and worker != entry.home:
            entry.second = worker
            entry.second_until = now + self.second_hold_s

    # -- background ---------------------------------------------------------------------

    def rebalance(
        self, by_model: Mapping[str, ModelRoutes], now: float, tokens: Mapping[str, int] | None = None,
    ) -> list[tuple[int, str, str]]:
        """Drop homes on workers that left or stopped taking traffic, recompute the placed work,
        and move at most one key per model from the most to the least pressed worker (see
        `pressures`) when theirs differ by more than `imbalance` (of the mean), if the move
        lowers the peak. `tokens`: the KV tokens in flight per worker now, by the account."""
        routable = {s.id for routes in by_model.values() for s in routes.routable}
        self.speeds = {s.id: s.speed for routes in by_model.values() for s in routes.routable}
        for wid in routable:
            held = float((tokens or {}).get(wid, 0))
            self.kv_avg[wid] = 0.7 * self.kv_avg.get(wid, held) + 0.3 * held
        for wid in [w for w in self.kv_avg if w not in routable]:
            del self.kv_avg[wid]
        placed: dict[str, float] = {}
        prefixes: dict[str, float] = {}
        for key, entry in list(self.keys.items()):
            work = self._decayed(entry, now)
            entry.work, entry.at = work, now
            if entry.home not in routable or work < 1e-3:
                # Its worker is gone or drained (the key finds a new home on its next
                # request), or the key has been idle for many half-lives.
                del self.keys[key]
                continue
            if entry.second is not None and entry.live_second(now) is None:
                entry.second = None
            if entry.second is not None and entry.second in routable:
                # A key with two homes loads both (they share it by load).
                placed[entry.home] = placed.get(entry.home, 0.0) + work / 2
                placed[entry.second] = placed.get(entry.second, 0.0) + work / 2
            else:
                placed[entry.home] = placed.get(entry.home, 0.0) + work
            prefixes[entry.home] = prefixes.get(entry.home, 0.0) + entry.cached()
        # In place: the gateway's `Live` view holds these very dicts.
        self.placed.clear()
        self.placed.update(placed)
        self.prefixes.clear()
        self.prefixes.update(prefixes)
        placed, prefixes = self.placed, self.prefixes
        moved: list[tuple[int, str, str]] = []
        for model, routes in by_model.items():
            move = self._one_move(model, routes)
            if move is None:
                continue
            key, src, dst = move
            entry = self.keys[key]
            entry.home, entry.second = dst, None
            placed[src] -= entry.work
            placed[dst] = placed.get(dst, 0.0) + entry.work
            prefixes[src] -= entry.cached()
            prefixes[dst] = prefixes.get(dst, 0.0) + entry.cached()
            moved.append(move)
        self.moves += len(moved)
        return moved

    # -- the measure both placement and rebalancing balance ---------------------------------

    def rho(self) -> float:
        """KV tokens in flight per unit of placed work at reference speed, fleet-wide (what a
        key's work costs the cache besides its prefix: on a worker of speed v, 1/v of that, as
        its requests take 1/v as long), from the account's recent average."""
        speeds = self.speeds
        work = sum((w / speeds.get(wid, 1.0) for wid, w in self.placed.items()), 0.0)
        held = sum(self.kv_avg.values(), 0.0) - sum(self.prefixes.values(), 0.0)
        return held / work if work > 0 and held > 0 else 0.0

    def pressures(
        self, slots: Sequence[Slot], extra: tuple[str, float, float] | None = None, rho: float | None = None,
    ) -> dict[str, float]:
        """Each worker's bottleneck use, relative to the fleet's mean (1.0 = its fair share):
        the larger of its placed work per unit of capacity and, where every worker declared
        its KV size, its cache demand (placed prefixes + the KV their work holds in flight)
        per cache token. `extra` = (worker, work, prefix tokens) adds a key there first."""
        rho = self.rho() if rho is None else rho
        work = {s.id: self.placed.get(s.id, 0.0) for s in slots}
        prefix = {s.id: self.prefixes.get(s.id, 0.0) for s in slots}
        if extra is not None:
            work[extra[0]] = work.get(extra[0], 0.0) + extra[1]
            prefix[extra[0]] = prefix.get(extra[0], 0.0) + extra[2]
        total_work = sum(work.values())
        total_weight = sum(s.weight for s in slots)
        use = {s.id: (work[s.id] / s.weight) / (total_work / total_weight) if total_work > 0 else 0.0
               for s in slots}
        if all(s.kv_tokens for s in slots):
            demand = {s.id: prefix[s.id] + rho * work[s.id] / s.speed for s in slots}
            total_demand = sum(demand.values())
            total_kv = sum(s.kv_tokens for s in slots)
            if total_demand > 0:
                for s in slots:
                    use[s.id] = max(use[s.id], (demand[s.id] / s.kv_tokens) / (total_demand / total_kv))
        return use

    def placement_costs(self, slots: Sequence[Slot], work: float, prefix: int) -> dict[str, float]:
        """For a new key (`work`, `prefix` tokens): each worker's own pressure were the key
        placed there (as `pressures`, in one pass)."""
        rho = self.rho()
        placed, prefixes = self.placed, self.prefixes
        total_work = sum(placed.get(s.id, 0.0) for s in slots) + work
        total_weight = sum(s.weight for s in slots)
        kv_known = all(s.kv_tokens for s in slots)
        base_demand = sum(prefixes.get(s.id, 0.0) + rho * placed.get(s.id, 0.0) / s.speed for s in slots)
        total_kv = sum(s.kv_tokens for s in slots)
        out: dict[str, float] = {}
        for s in slots:
            mine = placed.get(s.id, 0.0) + work
            cost = (mine / s.weight) / (total_work / total_weight) if total_work > 0 else 0.0
            # The fleet's demand with the key here (its in-flight KV lasts 1/speed as long).
            total_demand = base_demand + prefix + rho * work / s.speed
            if kv_known and total_demand > 0:
                demand = prefixes.get(s.id, 0.0) + prefix + rho * mine / s.speed
                cost = max(cost, (demand / s.kv_tokens) / (total_demand / total_kv))
            out[s.id] = cost
        return out

    def _one_move(self, model: str, routes: ModelRoutes) -> tuple[int, str, str] | None:
        slots = routes.routable
        if len(slots) < 2:
            return None
        rho = self.rho()
        now = self.pressures(slots, rho=rho)
        heavy = max(slots, key=lambda s: (now[s.id], s.id))
        light = min(slots, key=lambda s: (now[s.id], s.id))
        if now[heavy.id] - now[light.id] <= self.imbalance:
            return None
        peak = now[heavy.id]
        best: tuple[float, int] | None = None
        for key, entry in self.keys.items():
            if entry.home != heavy.id or entry.model != model or entry.need > light.max_len:
                continue
            # The pair's pressures with the key moved (placed work and prefix follow it).
            self.placed[heavy.id] -= entry.work
            self.prefixes[heavy.id] -= entry.cached()
            after = self.pressures(slots, (light.id, entry.work, entry.cached()), rho)
            self.placed[heavy.id] += entry.work
            self.prefixes[heavy.id] += entry.cached()
            worst = max(after.values())
            # Only a move that lowers the peak (a hot key that would just swap sides stays).
            if worst < peak * (1 - 1e-9) and (best is None or worst < best[0]):
                best = (worst, key)
        return None if best is None else (best[1], heavy.id, light.id)

    def _decayed(self, entry: KeyHome, now: float) -> float:
        dt = now - entry.at
        return entry.work * math.exp(-dt * math.log(2) / self.half_life_s) if dt > 0 else entry.work

    def _evict_coldest(self, now: float) -> None:
        coldest = min(self.keys, key=lambda k: self._decayed(self.keys[k], now))
        entry = self.keys.pop(coldest)
        self.prefixes[entry.home] = self.prefixes.get(entry.home, 0.0) - entry.cached()



__all__ = ["Homes", "KeyHome"]
