"""The Redis registry: every read and write of the fleet's records, shared by gateway and agents.

It is the one place that talks to Redis about the fleet. The schema is in three small
modules beside it: `fleetgate/keys.py` (the key layout, drawn there, and the TTLs),
`fleetgate/records.py` (encoding a worker's hash and checking its signature) and
`fleetgate/connection.py` (opening a client from a URL: standalone, Sentinel, Cluster).
What gateway replicas share with each other (in-flight counts, LoRA placement, rate
limits, where stored responses live) is `fleetgate/shared_accounts.py`, which `Registry`
inherits, so that one handle serves both.
Every write is atomic (MULTI pipelines or single-key Lua scripts), and writes to
an existing worker never recreate a key that has expired. Events are published
after the write they announce.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.exceptions import OutOfMemoryError, ResponseError

from fleetgate.connection import connect
from fleetgate.keys import (
    DEFAULT_HEARTBEAT_TTL_S,
    DEFAULT_PREFIX,
    REJECTED_TTL_S,
    REMOVED_TTL_S,
    Keys,
)
from fleetgate.records import decode_worker, encode, sign, unsigned
from fleetgate.schema import Load, WorkerInfo, WorkerState, WorkerView
from fleetgate.sentinel import follow_master
from fleetgate.shared_accounts import SharedAccounts

__all__ = ["DEFAULT_HEARTBEAT_TTL_S", "DEFAULT_PREFIX", "HeartbeatReply", "Keys", "LoadNotStored", "Registry",
           "connect", "out_of_memory"]

# Updates fields of a worker hash only while it exists, refreshing its TTL when asked.
# KEYS[1] = worker hash; ARGV[1] = ttl ms (0: keep), ARGV[2..] = field, value pairs.
_UPDATE_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
if tonumber(ARGV[1]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
if redis.call('HGET', KEYS[1], 'stop') == '1' then return 2 end
if redis.call('HGET', KEYS[1], 'drain') == '1' then return 3 end
return 1
"""

# The same answer, renewing the TTL only: no command here needs memory, so Redis at maxmemory
# (noeviction), which refuses the HSET above, still runs it. KEYS[1] = worker hash; ARGV[1] = ttl ms.
_KEEP_ALIVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[1], 'stop') == '1' then return 2 end
if redis.call('HGET', KEYS[1], 'drain') == '1' then return 3 end
return 1
"""

HeartbeatReply = Literal["ok", "missing", "stop", "drained"]
_REPLIES: dict[int, HeartbeatReply] = {0: "missing", 1: "ok", 2: "stop", 3: "drained"}


def out_of_memory(exc: BaseException) -> bool:
    """Whether Redis refused a write for want of memory (maxmemory reached, noeviction). Redis 7
    says so as an OOM error; Redis 6.2, inside a script, as a script error that quotes it."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "OOM command not allowed" in str(exc))


class LoadNotStored(Exception):
    """Redis refused to store a heartbeat's load (it is at maxmemory with noeviction); the record's
    TTL was renewed all the same, so the worker stays in the fleet with the load it last stored.
    `reply` is the heartbeat's answer."""

    def __init__(self, reply: HeartbeatReply) -> None:
        super().__init__("Redis is full (maxmemory): the load was not stored, the record kept alive")
        self.reply = reply


class Registry(SharedAccounts):
    """Reads and writes the fleet's records in Redis. Shared by gateway and agents; the
    accounts gateway replicas share come with it (fleetgate/shared_accounts.py)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str = DEFAULT_PREFIX,
        heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S,
        secret: str = "",
    ) -> None:
        # Shared by agents and gateways: only records signed with it are routed to.
        self.secret = secret
        super().__init__(redis, Keys(prefix))
        self.ttl_ms = int(heartbeat_ttl_s * 1000)
        self._update = redis.register_script(_UPDATE_IF_EXISTS)
        self._keep_alive = redis.register_script(_KEEP_ALIVE)

    # -- agent side ---------------------------------------------------------

    async def register(
        self, info: WorkerInfo, state: WorkerState, load: Load | None = None, *, admin_drain: bool = False
    ) -> None:
        """Create (or replace) a worker's record and announce it.

        `admin_drain` re-asserts an operator's drain that the agent was told of (a Redis
        restart lost it with the record); otherwise the field is left as it is.
        """
        key = self.keys.worker(info.id)
        raw = encode(info)
        fields: dict[str, bytes | str] = {"info": raw, "state": state, "hb": repr(time.time())}
        if self.secret:
            fields["sig"] = sign(self.secret, raw)
        if load is not None:
            fields["load"] = encode(load)
        if admin_drain:
            fields["drain"] = "1"
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(key, self.ttl_ms)
            pipe.sadd(self.keys.workers, info.id)
            pipe.delete(self.keys.removed(info.id))
            pipe.delete(self.keys.rejected(info.id))  # a gateway says so again if it still is
            await pipe.execute()
        await self._announce(info.id)

    async def heartbeat(self, worker_id: str, load: Load, *, announce: bool = False) -> HeartbeatReply:
        """Refresh a worker's TTL and load; `announce` tells readers at once (a change that
        routing must see now, such as the engine turning unhealthy).

        "missing": the record is gone (expired, Redis restarted, or removed): register again
        unless `was_removed`. "stop": an operator asked this worker to drain and stop.
        "drained": an operator drained it (the agent remembers, to re-assert it when it
        registers again).

        Raises LoadNotStored when Redis is full: a worker must not leave the fleet because Redis
        cannot take its load, so its record lives on with the last one stored.
        """
        key = self.keys.worker(worker_id)
        try:
            reply = await self._update(keys=[key], args=[self.ttl_ms, "load", encode(load), "hb", repr(time.time())])
        except ResponseError as exc:
            if not out_of_memory(exc):
                raise
            kept = await self._keep_alive(keys=[key], args=[self.ttl_ms])
            raise LoadNotStored(_REPLIES.get(int(kept), "ok")) from exc
        if announce and reply:
            await self._announce(worker_id)
        return _REPLIES.get(int(reply), "ok")

    async def set_state(self, worker_id: str, state: WorkerState) -> bool:
        return await self._set_fields(worker_id, "state", state)

    async def update_info(self, info: WorkerInfo) -> bool:
        raw = encode(info)
        if self.secret:
            return await self._set_fields(info.id, "info", raw, "sig", sign(self.secret, raw))
        return await self._set_fields(info.id, "info", raw)

    async def request_stop(self, worker_id: str) -> bool:
        """Drain the worker and ask its agent to stop once drained."""
        return await self._set_fields(worker_id, "drain", "1", "stop", "1")

    # -- operator side ------------------------------------------------------

    async def set_admin_drain(self, worker_id: str, drain: bool) -> bool:
        """Mark a worker drained (or not) for every gateway. False if it is not registered."""
        return await self._set_fields(worker_id, "drain", "1" if drain else "0")

    async def deregister(self, worker_id: str, *, by_operator: bool = False) -> bool:
        """Remove a worker's record. True if there was one.

        `by_operator` leaves a tombstone that tells a still-running agent to stop
        rather than register again.
        """
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.worker(worker_id))
            pipe.srem(self.keys.workers, worker_id)
            if by_operator:
                pipe.set(self.keys.removed(worker_id), "1", ex=REMOVED_TTL_S)
            results = await pipe.execute()
        await self._announce(worker_id)
        return bool(results[0])

    async def was_removed(self, worker_id: str) -> bool:
        """Whether an operator removed this worker recently."""
        return bool(await self.redis.exists(self.keys.removed(worker_id)))

    # -- reader side --------------------------------------------------------

    async def read_all(self, rejected: dict[str, str] | None = None) -> list[WorkerView]:
        """Every live worker. Ids whose record expired are pruned from the index (unless its
        agent registered again meanwhile: `prune_index`); those whose record is not signed
        with the registration secret go into `rejected` (id -> why)."""
        members = await self.redis.smembers(self.keys.workers)  # type: ignore[misc]
        ids = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for worker_id in ids:
                pipe.hgetall(self.keys.worker(worker_id))
                pipe.get(self.keys.circuit(worker_id))
            rows: Sequence[Any] = await pipe.execute()
        views: list[WorkerView] = []
        gone: list[str] = []
        for i, worker_id in enumerate(ids):
            fields, circuit = rows[2 * i], rows[2 * i + 1]
            if not fields:
                gone.append(worker_id)
                continue
            if rejected is not None and (why := unsigned(fields, self.secret)):
                rejected[worker_id] = why
            view = decode_worker(fields, circuit, self.secret)
            if view is not None:
                views.append(view)
        if gone:
            await self.prune_index(self.keys.workers, self.keys.worker, gone)
        return views

    async def read(self, worker_id: str) -> WorkerView | None:
        fields = await self.redis.hgetall(self.keys.worker(worker_id))  # type: ignore[misc]
        circuit = await self.redis.get(self.keys.circuit(worker_id))
        return decode_worker(fields, circuit, self.secret) if fields else None  # type: ignore[arg-type]

    # -- circuit breakers (written by gateways, read by every gateway) ----------------

    async def open_circuit(self, worker_id: str, reason: str, cooldown_s: float) -> None:
        await self.redis.set(self.keys.circuit(worker_id), reason, px=max(1, int(cooldown_s * 1000)))
        await self._announce(worker_id)

    async def close_circuit(self, worker_id: str) -> None:
        await self.redis.delete(self.keys.circuit(worker_id))
        await self._announce(worker_id)

    # -- records gateways ignore (registration secret) --------------------------------

    async def reject(self, worker_id: str, reason: str) -> None:
        """Tell worker `worker_id`'s agent that gateways ignore its record, and why."""
        await self.redis.set(self.keys.rejected(worker_id), reason, ex=REJECTED_TTL_S)

    async def rejection(self, worker_id: str) -> str | None:
        """Why gateways ignore this worker's record (None: they do not, as far as they said)."""
        raw = await self.redis.get(self.keys.rejected(worker_id))
        return raw.decode(errors="replace") if isinstance(raw, bytes) else raw

    async def mark_epoch(self) -> bool:
        """True when Redis holds none of this fleet's state any more (first start, or a
        restart that lost its memory): readers then keep their last view a little longer."""
        return bool(await self.redis.set(self.keys.epoch, repr(time.time()), nx=True))

    async def follow_master(self) -> str:
        """With Sentinel: reconnect to the master the sentinels name, if it moved while the
        old one stayed up ("host:port" then, else ""; fleetgate/sentinel.py says why)."""
        return await follow_master(self.redis)

    async def subscribe(self) -> aioredis.client.PubSub:
        """A pub/sub connection listening on the events channel (its data: worker ids)."""
        # A cluster client learns the slot map on its first command; pub/sub needs it first.
        await self.redis.initialize()
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.keys.events)
        except BaseException:
            await pubsub.aclose()
            raise
        return pubsub

    async def _set_fields(self, worker_id: str, *pairs: str | bytes) -> bool:
        ok = await self._update(keys=[self.keys.worker(worker_id)], args=[0, *pairs])
        if ok:
            await self._announce(worker_id)
        return bool(ok)

    async def _announce(self, worker_id: str) -> None:
        """Tell every reader that something about `worker_id` changed. Sent after the write
        it announces (never inside a MULTI: Redis Cluster clients refuse PUBLISH there), so
        a reader that hears it reads the new state."""
        await self.redis.publish(self.keys.events, worker_id)
