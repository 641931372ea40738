"""The Redis registry: the one module that knows key names, TTLs and record encoding.

Layout (``P`` is the key prefix, ``v1`` the schema version)::

    {P}:v1:workers        SET   ids of registered workers (an index; stale ids are pruned by readers)
    {P}:v1:w:<id>         HASH  info  -> WorkerInfo JSON (written by the agent)
                                state -> starting|ready|draining (written by the agent)
                                drain -> "1" when an operator drained it (written by the admin API;
                                         re-asserted by its agent after a Redis restart)
                                load  -> Load JSON (refreshed by the agent's heartbeat)
                                hb    -> unix time of the last heartbeat
                                sig   -> HMAC-SHA256 of `info` with the registration secret
                                         (when one is set, readers ignore unsigned records)
                                stop  -> "1" when an operator asked the agent to stop
                          PEXPIRE heartbeat_ttl: a worker whose agent dies vanishes by itself
    {P}:v1:removed:<id>   STRING set when an operator removes a worker (TTL 10 min), so its
                          agent stops instead of registering again
    {P}:v1:events         PUBSUB a worker id whenever something about it changed
    {P}:v1:circuit:<id>   STRING why a gateway's circuit breaker took the worker out of routing,
                          PX cooldown (+ the probe's timeout): when it expires the worker gets
                          traffic again (half-open)
    {P}:v1:rejected:<id>  STRING why gateways ignore worker <id>'s record (not signed, or signed
                          with another registration secret), written by a gateway that read it,
                          EX REJECTED_TTL_S: the agent reads it (`rejection`) to learn it is ignored
    {P}:v1:epoch          STRING set once by the first gateway; its absence means Redis lost
                          everything (a restart without persistence)
    {P}:v1:gateways       SET   ids of gateways that publish in-flight counts (pruned by readers)
    {P}:v1:inflight:<gw>  HASH  worker id -> requests gateway <gw> has in flight there,
                          rewritten whole every ~100 ms, PEXPIRE lease: a gateway that crashes
                          leaks nothing, its counts vanish with the lease
    {P}:v1:rate:<key id>  STRING per-client rate limit (GCRA): the theoretical arrival time, in
                          ms of Redis's clock, of the client's next request; PX until then
    {P}:v1:resp:<id>      STRING the worker that created (and stores) Responses API response
                          <id>, so a follow-up (`previous_response_id`), a retrieve or a cancel
                          reaches it from any gateway; PX the gateway's `responses_ttl_s`
    {P}:v1:adapters       HASH  adapter name -> {"path", "base"} JSON: adapters an operator added
                          through the admin API, so every gateway (and one that restarts) can
                          place them
    {P}:v1:lora:<gw>      HASH  "<worker>\t<adapter>" -> requests gateway <gw> has in flight for
                          that adapter on that worker, rewritten whole every ~200 ms, PEXPIRE
                          lease (like inflight:<gw>): no gateway evicts an adapter in use
    {P}:v1:lora_used:<id> ZSET  adapter -> unix time a gateway last sent it to worker <id> (the
                          LRU every gateway evicts by), PEXPIRE 1 h after the last write
    {P}:v1:lora_lock:<a>  STRING the gateway loading adapter <a> (one load of it at a time in the
                          fleet), PX the load's time limit

The prefix is wrapped in a hash tag so every key lands in one Redis Cluster slot:
multi-key pipelines and the Lua scripts below work unchanged on a cluster.
Every write is atomic (MULTI pipelines or single-key Lua scripts), and writes to
an existing worker never recreate a key that has expired. Events are published
after the write they announce.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import redis.asyncio as aioredis

from fleetgate.hashing import stable_hash
from fleetgate.schema import SCHEMA_VERSION, Load, WorkerInfo, WorkerState, WorkerView
from fleetgate.sentinel import follow_master

DEFAULT_PREFIX = "fleetgate"
DEFAULT_HEARTBEAT_TTL_S = 3.0
DEFAULT_INFLIGHT_LEASE_S = 3.0
REMOVED_TTL_S = 600
REJECTED_TTL_S = 120
_LEASE_FIELD = "_at"

_info_encoder = msgspec.json.Encoder()
_info_decoder = msgspec.json.Decoder(WorkerInfo)
_load_decoder = msgspec.json.Decoder(Load)

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
_LORA_USED_TTL_MS = 3_600_000

HeartbeatReply = Literal["ok", "missing", "stop", "drained"]
_REPLIES: dict[int, HeartbeatReply] = {0: "missing", 1: "ok", 2: "stop", 3: "drained"}


def sign(secret: str, info: bytes) -> str:
    return hmac.new(secret.encode(), info, hashlib.sha256).hexdigest()


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """Open an asyncio Redis client for ``url``.

    ``redis://``, ``rediss://`` and ``unix://`` as redis-py reads them; Sentinel as
    ``redis+sentinel://[:password@]host1:26379,host2:26379/<master name>[/<db>]``: the
    client asks the sentinels for the current master and follows a failover; Redis
    Cluster as ``redis+cluster://[:password@]host1:7000,host2:7001`` (any reachable nodes:
    the client learns the rest and follows slot moves and failovers). Every key lives in
    one slot (the prefix is a hash tag), so a cluster gives failover, not sharding.
    """
    kwargs.setdefault("socket_connect_timeout", 2.0)
    kwargs.setdefault("socket_timeout", 5.0)
    kwargs.setdefault("health_check_interval", 10)
    if url.startswith("redis+sentinel://"):
        return _sentinel_master(url, **kwargs)
    if url.startswith("redis+cluster://"):
        return _cluster(url, **kwargs)
    return aioredis.from_url(url, **kwargs)


def _nodes(url: str, scheme: str, default_port: int) -> tuple[str | None, list[tuple[str, int]], list[str]]:
    """`scheme[:password@]host:port,host:port[/a/b]` -> (password, [(host, port)], [a, b])."""
    rest = url.removeprefix(scheme)
    password = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        password = auth.partition(":")[2] or None
    hosts, _, path = rest.partition("/")
    nodes = []
    for node in hosts.split(","):
        host, _, port = node.rpartition(":")
        nodes.append((host or node, int(port) if port.isdigit() else default_port))
    return password, nodes, [p for p in path.split("/") if p]


def _sentinel_master(url: str, **kwargs: Any) -> aioredis.Redis:
    from redis.asyncio.sentinel import Sentinel

    password, nodes, parts = _nodes(url, "redis+sentinel://", 26379)
    if not parts:
        raise ValueError("a Sentinel URL names the master: redis+sentinel://host:26379/<master>[/<db>]")
    db = int(parts[1]) if len(parts) > 1 else 0
    # The sentinels are asked about once a second (fleetgate/sentinel.py): bound every wait.
    timeouts = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs}
    sentinel = Sentinel(nodes, sentinel_kwargs={**timeouts, **({"password": password} if password else {})})
    return sentinel.master_for(parts[0], db=db, password=password, **kwargs)


def _cluster(url: str, **kwargs: Any) -> aioredis.Redis:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    password, nodes, parts = _nodes(url, "redis+cluster://", 6379)
    if parts not in ([], ["0"]):
        raise ValueError("Redis Cluster has only database 0: redis+cluster://host:7000,host:7001")
    # A cluster client is not a Redis subclass, but offers every command the registry uses.
    return RedisCluster(  # type: ignore[return-value]
        startup_nodes=[ClusterNode(host, port) for host, port in nodes], password=password, **kwargs
    )


class Keys:
    """Key names for one fleet (one prefix)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        base = f"{{{prefix}}}:v{SCHEMA_VERSION}"
        self.workers = f"{base}:workers"
        self.events = f"{base}:events"
        self._worker = f"{base}:w:"
        self._removed = f"{base}:removed:"
        self._circuit = f"{base}:circuit:"
        self._rejected = f"{base}:rejected:"
        self.gateways = f"{base}:gateways"
        self.epoch = f"{base}:epoch"
        self._inflight = f"{base}:inflight:"
        self._rate = f"{base}:rate:"
        self._response = f"{base}:resp:"
        self.adapters = f"{base}:adapters"
        self._lora = f"{base}:lora:"
        self._lora_used = f"{base}:lora_used:"
        self._lora_lock = f"{base}:lora_lock:"

    def worker(self, worker_id: str) -> str:
        return self._worker + worker_id

    def removed(self, worker_id: str) -> str:
        return self._removed + worker_id

    def circuit(self, worker_id: str) -> str:
        return self._circuit + worker_id

    def rejected(self, worker_id: str) -> str:
        return self._rejected + worker_id

    def inflight(self, gateway_id: str) -> str:
        return self._inflight + gateway_id

    def rate(self, client_id: str) -> str:
        return self._rate + client_id

    def response(self, response_id: str) -> str:
        return self._response + response_id

    def lora(self, gateway_id: str) -> str:
        return self._lora + gateway_id

    def lora_used(self, worker_id: str) -> str:
        return self._lora_used + worker_id

    def lora_lock(self, adapter: str) -> str:
        return self._lora_lock + adapter


def unsigned(fields: dict[bytes, bytes], secret: str) -> str:
    """Why a worker hash is not signed with `secret` ("" when it is, or no secret is set)."""
    raw_info = fields.get(b"info")
    if not secret or not raw_info:
        return ""
    sig = fields.get(b"sig", b"").decode(errors="replace")
    if hmac.compare_digest(sig, sign(secret, raw_info)):
        return ""
    return "signed with another registration secret" if sig else "not signed (no registration secret)"


def decode_worker(
    fields: dict[bytes, bytes], circuit: bytes | None = None, secret: str = ""
) -> WorkerView | None:
    """A worker hash as read from Redis, or None if it is incomplete, of another schema,
    or (with a registration secret) not signed with it."""
    raw_info = fields.get(b"info")
    if not raw_info or unsigned(fields, secret):
        return None
    try:
        info = _info_decoder.decode(raw_info)
    except msgspec.DecodeError:
        return None
    if info.schema != SCHEMA_VERSION:
        return None
    state = fields.get(b"state", b"starting").decode()
    if state not in ("starting", "ready", "draining"):
        state = "starting"
    raw_load = fields.get(b"load")
    try:
        load = _load_decoder.decode(raw_load) if raw_load else Load()
    except msgspec.DecodeError:
        load = Load()
    return WorkerView(
        info=info,
        state=state,  # type: ignore[arg-type]
        load=load,
        last_heartbeat=float(fields.get(b"hb", b"0") or 0),
        admin_drain=fields.get(b"drain") == b"1",
        id_hash=stable_hash(info.id),
        circuit=circuit.decode(errors="replace") if circuit else "",
    )


class Registry:
    """Reads and writes the fleet's records in Redis. Shared by gateway and agents."""

    def __init__(
        self,
        redis: aioredis.Redis,
        prefix: str = DEFAULT_PREFIX,
        heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S,
        secret: str = "",
    ) -> None:
        self.redis = redis
        # Shared by agents and gateways: only records signed with it are routed to.
        self.secret = secret
        self.keys = Keys(prefix)
        self.ttl_ms = int(heartbeat_ttl_s * 1000)
        self._update = redis.register_script(_UPDATE_IF_EXISTS)
        self._take = redis.register_script(_TAKE)
        self._unlock = redis.register_script(_UNLOCK)

    # -- agent side ---------------------------------------------------------

    async def register(
        self, info: WorkerInfo, state: WorkerState, load: Load | None = None, *, admin_drain: bool = False
    ) -> None:
        """Create (or replace) a worker's record and announce it.

        `admin_drain` re-asserts an operator's drain that the agent was told of (a Redis
        restart lost it with the record); otherwise the field is left as it is.
        """
        key = self.keys.worker(info.id)
        raw = _info_encoder.encode(info)
        fields: dict[str, bytes | str] = {"info": raw, "state": state, "hb": repr(time.time())}
        if self.secret:
            fields["sig"] = sign(self.secret, raw)
        if load is not None:
            fields["load"] = _info_encoder.encode(load)
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
        """
        reply = await self._update(
            keys=[self.keys.worker(worker_id)],
            args=[self.ttl_ms, "load", _info_encoder.encode(load), "hb", repr(time.time())],
        )
        if announce and reply:
            await self._announce(worker_id)
        return _REPLIES.get(int(reply), "ok")

    async def set_state(self, worker_id: str, state: WorkerState) -> bool:
        return await self._set_fields(worker_id, "state", state)

    async def update_info(self, info: WorkerInfo) -> bool:
        raw = _info_encoder.encode(info)
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
        """Every live worker. Ids whose record expired are pruned from the index; those whose
        record is not signed with the registration secret go into `rejected` (id -> why)."""
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
            await self.redis.srem(self.keys.workers, *gone)
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

    # -- in-flight counts shared by gateway replicas --------------------------------

    async def publish_inflight(
        self, gateway_id: str, counts: dict[str, int], lease_s: float = DEFAULT_INFLIGHT_LEASE_S
    ) -> None:
        """Replace this gateway's in-flight counts (atomically) and renew their lease."""
        key = self.keys.inflight(gateway_id)
        # The hash always holds `_at`, so it exists exactly while the gateway lives.
        fields: dict[str, object] = {worker: n for worker, n in counts.items() if n > 0}
        fields[_LEASE_FIELD] = repr(time.time())
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(key, int(lease_s * 1000))
            pipe.sadd(self.keys.gateways, gateway_id)
            await pipe.execute()

    async def read_inflight(self, exclude_gateway: str = "") -> dict[str, int]:
        """Requests in flight per worker, summed over every gateway but `exclude_gateway`."""
        members = await self.redis.smembers(self.keys.gateways)  # type: ignore[misc]
        ids = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
        ids = [i for i in ids if i != exclude_gateway]
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for gateway_id in ids:
                pipe.hgetall(self.keys.inflight(gateway_id))
            rows = await pipe.execute()
        total: dict[str, int] = {}
        dead = []
        for gateway_id, row in zip(ids, rows, strict=True):
            if not row:
                dead.append(gateway_id)
            for worker, n in row.items():
                name = worker.decode() if isinstance(worker, bytes) else str(worker)
                if name != _LEASE_FIELD:
                    total[name] = total.get(name, 0) + int(n)
        if dead:
            await self.redis.srem(self.keys.gateways, *dead)
        return total

    async def mark_epoch(self) -> bool:
        """True when Redis holds none of this fleet's state any more (first start, or a
        restart that lost its memory): readers then keep their last view a little longer."""
        return bool(await self.redis.set(self.keys.epoch, repr(time.time()), nx=True))

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
        fields[_LEASE_FIELD] = repr(time.time())
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
        members = await self.redis.smembers(self.keys.gateways)  # type: ignore[misc]
        ids = sorted(m.decode() if isinstance(m, bytes) else str(m) for m in members)
        ids = [i for i in ids if i != exclude_gateway]
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for gateway_id in ids:
                pipe.hgetall(self.keys.lora(gateway_id))
            rows = await pipe.execute()
        total: dict[tuple[str, str], int] = {}
        for row in rows:
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
