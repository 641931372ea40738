"""What gateway replicas share with each other in Redis, beside the fleet's records.

Each gateway keeps its own accounts and publishes them under a lease, so that every replica
(and an agent waiting for its worker to drain) sees the fleet's total: requests in flight
per worker and per (worker, adapter), when each adapter was last sent to each worker, the
adapters an operator added, the lock that lets one gateway at a time load an adapter,
each client's rate limit, and which worker holds a stored Responses API response.
`Registry` (fleetgate/registry.py) inherits these, so that one handle serves both; the key
layout is fleetgate/keys.py's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import redis.asyncio as aioredis

from fleetgate.keys import DEFAULT_INFLIGHT_LEASE_S, LEASE_FIELD, Keys

__all__ = ["SharedAccounts"]

# Generic cell rate algorithm: one key per client, shared by every gateway, Redis's clock.
# KEYS[1] = rate key; ARGV[1] = ms between requests at the steady rate; ARGV[2] = burst.
# Returns {allowed (0/1), remaining requests now, ms until the next one is allowed}.
_TAKE = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local interval = tonumber(ARGV[1])
local tolerance = interval * (tonumber(ARGV[2]) - 1)
local tat = tonumber(redis.call('GET', KEYS[1]) or now)
if tat < now then tat = now end
if tat - now > tolerance then
  return {0, 0, tat - now - tolerance}
end
local next_tat = tat + interval
redis.call('SET', KEYS[1], string.format('%d', next_tat), 'PX', string.format('%d', next_tat - now))
return {1, math.floor((tolerance - (next_tat - now)) / interval) + 1, 0}
"""

# Deletes a lock only while its value is still the caller's. KEYS[1] = lock; ARGV[1] = owner.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# Removes from an index (a SET of ids) the ids whose record is gone, checked here and now:
# one registered again since the reader saw it gone stays (its agent's heartbeats find the
# record and never register it again, so a lost id would hide a live record for good).
# KEYS[1] = index; KEYS[i + 1] = the record of id ARGV[i]. Returns how many ids it removed.
_PRUNE = """
local removed = 0
for i = 1, #ARGV do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then removed = removed + redis.call('SREM', KEYS[1], ARGV[i]) end
end
return removed
"""
_LORA_USED_TTL_MS = 3_600_000


class SharedAccounts:
    """The accounts gateway replicas share: each writes its own, leased; readers sum them."""

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._take = redis.register_script(_TAKE)
        self._unlock = redis.register_script(_UNLOCK)
        self._prune = redis.register_script(_PRUNE)

    async def prune_index(self, index: str, record: Callable[[str], str], ids: Sequence[str]) -> int:
        """Remove from `index` those of `ids` (read gone) whose `record(id)` is still gone."""
        return int(await self._prune(keys=[index, *(record(i) for i in ids)], args=list(ids)))

    # -- in-flight counts shared by gateway replicas --------------------------------

    async def publish_inflight(
        self, gateway_id: str, counts: dict[str, int], lease_s: float = DEFAULT_INFLIGHT_LEASE_S
    ) -> None:
        """Replace this gateway's in-flight counts (atomically) and renew their lease."""
        key = self.keys.inflight(gateway_id)
        # The hash always holds `_at`, so it exists exactly while the gateway lives.
        fields: dict[str, object] = {worker: n for worker, n in counts.items() if n > 0}
        fields[LEASE_FIELD] = repr(time.time())
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(key, int(lease_s * 1000))
            pipe.sadd(self.keys.gateways, gateway_id)
            await pipe.execute()

    async def read_inflight(self, exclude_gateway: str = "") -> dict[str, int]:
        """Requests in flight per worker, summed over every gateway but `exclude_gateway`."""
        total: dict[str, int] = {}
        dead = []
        for gateway_id, row in await self._peer_hashes(exclude_gateway, self.keys.inflight):
            if not row:
                dead.append(gateway_id)
            for worker, n in row.items():
                name = worker.decode() if isinstance(worker, bytes) else str(worker)
                if name != LEASE_FIELD:
                    total[name] = total.get(name, 0) + int(n)
        if dead:
            await self.prune_index(self.keys.gateways, self.keys.inflight, dead)
        return total

    async def _peer_hashes(self, exclude_gateway: str, key: Callable[[str], str]) -> list[tuple[str, dict[Any, Any]]]:
        """(gateway, its hash under `key(gateway)`) for every gateway in the in-flight counts'
        index but `exclude_gateway`, in one round trip after the index's."""
        members = await self.redis.smembers(self.keys.gateways)  # type: ignore[misc]
        ids = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
        ids = [i for i in ids if i != exclude_gateway]
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for gateway_id in ids:
                pipe.hgetall(key(gateway_id))
            rows = await pipe.execute()
        return list(zip(ids, rows, strict=True))

    async def forget_gateway(self, gateway_id: str) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.inflight(gateway_id))
            pipe.delete(self.keys.lora(gateway_id))
            pipe.srem(self.keys.gateways, gateway_id)
            await pipe.execute()

    # -- rate limits shared by gateway replicas ---------------------------------------

    async def take(self, client_id: str, per_minute: float, burst: int) -> tuple[bool, int, float]:
        """One request of `client_id` against its limit: (allowed, requests left now,
        seconds until the next one is allowed when refused)."""
        interval_ms = max(1, round(60_000 / per_minute))
        allowed, remaining, wait_ms = await self._take(
            keys=[self.keys.rate(client_id)], args=[interval_ms, max(1, burst)]
        )
        return bool(allowed), int(remaining), int(wait_ms) / 1000

    # -- where stored Responses API responses live ---------------------------------------

    async def remember_response(self, response_id: str, worker_id: str, ttl_s: float) -> None:
        await self.redis.set(self.keys.response(response_id), worker_id, px=max(1, int(ttl_s * 1000)))

    async def response_worker(self, response_id: str) -> str | None:
        raw = await self.redis.get(self.keys.response(response_id))
        return raw.decode() if isinstance(raw, bytes) else raw

    # -- LoRA placement shared by gateway replicas ----------------------------------------

    async def save_adapter(self, name: str, spec: bytes) -> None:
        """Remember an adapter an operator added (`spec`: its {"path", "base"} JSON)."""
        await self.redis.hset(self.keys.adapters, name, spec)  # type: ignore[misc]

    async def read_adapters(self) -> dict[str, bytes]:
        rows = await self.redis.hgetall(self.keys.adapters)  # type: ignore[misc]
        return {(k.decode() if isinstance(k, bytes) else str(k)): v if isinstance(v, bytes) else str(v).encode()
                for k, v in rows.items()}

    async def publish_lora(
        self, gateway_id: str, inflight: dict[tuple[str, str], int], used: dict[tuple[str, str], float],
        lease_s: float = DEFAULT_INFLIGHT_LEASE_S,
    ) -> None:
        """Replace this gateway's per-(worker, adapter) in-flight counts under a lease, and
        record when it last sent each adapter to each worker (never moving a time back)."""
        key = self.keys.lora(gateway_id)
        fields: dict[str, object] = {f"{w}\t{a}": n for (w, a), n in inflight.items() if n > 0}
        fields[LEASE_FIELD] = repr(time.time())
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(key, int(lease_s * 1000))
            by_worker: dict[str, dict[str, float]] = {}
            for (worker, adapter), at in used.items():
                by_worker.setdefault(worker, {})[adapter] = at
            for worker, scores in by_worker.items():
                pipe.zadd(self.keys.lora_used(worker), scores, gt=True)  # type: ignore[arg-type]
                pipe.pexpire(self.keys.lora_used(worker), _LORA_USED_TTL_MS)
            await pipe.execute()

    async def read_lora(self, exclude_gateway: str = "") -> dict[tuple[str, str], int]:
        """Adapter requests in flight per (worker, adapter), summed over every gateway but
        `exclude_gateway` (gateways as listed by the in-flight counts' index)."""
        total: dict[tuple[str, str], int] = {}
        for _, row in await self._peer_hashes(exclude_gateway, self.keys.lora):
            for raw, n in row.items():
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
                worker, sep, adapter = name.partition("\t")
                if sep:
                    total[(worker, adapter)] = total.get((worker, adapter), 0) + int(n)
        return total

    async def read_lora_used(self, worker_ids: Sequence[str]) -> dict[tuple[str, str], float]:
        """When any gateway last sent each adapter to each of these workers (unix time)."""
        if not worker_ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker in worker_ids:
                pipe.zrange(self.keys.lora_used(worker), 0, -1, withscores=True)
            rows = await pipe.execute()
        used: dict[tuple[str, str], float] = {}
        for worker, row in zip(worker_ids, rows, strict=True):
            for adapter, at in row:
                used[(worker, adapter.decode() if isinstance(adapter, bytes) else str(adapter))] = float(at)
        return used

    async def lock_adapter(self, adapter: str, owner: str, ttl_s: float) -> bool:
        """Take the fleet-wide lock on loading `adapter`; False while another gateway holds it."""
        return bool(await self.redis.set(self.keys.lora_lock(adapter), owner, nx=True,
                                         px=max(1, int(ttl_s * 1000))))

    async def unlock_adapter(self, adapter: str, owner: str) -> None:
        """Release the lock if `owner` still holds it (it may have expired and been retaken)."""
        await self._unlock(keys=[self.keys.lora_lock(adapter)], args=[owner])
