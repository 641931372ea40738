"""Each worker's prefix-cache index in Redis: the agent writes it, every gateway mirrors it.

Why through Redis and not each gateway subscribing to every engine's ZMQ socket: the agent
sits next to its engine and is its only subscriber, so the engine's events (which carry the
prompts' token ids) stay on loopback, and the engine serves one replay, not one per gateway.
A gateway that starts, restarts or is added reads the current index from Redis; rebuilding
it from the engines' replay buffers would fail once an engine has published more batches
than its buffer holds (10,000 by default), and routing history is no substitute. Gateways
already read the registry from Redis in the background, so this adds one or two round trips
per refresh for the whole fleet and none per request.

Layout (``P`` the fleet's prefix, the hash tag and schema version of fleetgate/keys.py)::

    {P}:v1:kv:<id>      STREAM  one entry per change of worker <id>'s index, id "<gen>-<ver>":
                                a  added keys, d  removed keys (little-endian int64s, packed),
                                c  "1": start from an empty index (AllBlocksCleared, a resync),
                                s  state ("events" | "lost"), r  why lost, bs  block size
                        XADD MAXLEN ~ 1024; PEXPIRE ttl, refreshed by the writer
    {P}:v1:kvsnap:<id>  STRING  the whole index at one entry: msgpack
                                [gen, ver, state, reason, block_size, keys packed]; written with
                                the generation's first entry and every 256th, in the same
                                MULTI as that entry; PEXPIRE ttl

`gen` is the writer's start time in ms (above any id already in the stream), `ver` counts
its entries from 1: a stream id says which index version an entry turns into which. A reader
at (gen, ver) reads the entries after "<gen>-<ver>" (one XREAD for every worker); an entry of
another generation or a version that is not ver + 1 (trimmed away, or a new agent) sends it
back to the snapshot. Snapshots are rewritten well within the stream's length, so a reader
that loads one finds the entries that follow it. Plain strings and streams: Redis 6.2 and 7.0
alike, and every key under the prefix's hash tag (one Cluster slot, multi-key commands fine).

Keys are fleetgate/kv_index.py's chain keys (computed from token ids), so a gateway looks a
prompt up with `WorkerKv.cached_blocks(chain_keys(ids, wkv.block_size, lora))`.
"""

from __future__ import annotations

import math
import sys
import time
from array import array
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import redis.asyncio as aioredis
import structlog

from fleetgate.background import Outage, repeat
from fleetgate.keys import DEFAULT_PREFIX, Keys
from fleetgate.kv_index import BlockIndex

__all__ = [
    "KvIndexWriter",
    "KvMirror",
    "WorkerKv",
    "pack_keys",
    "unpack_keys",
]

log = structlog.get_logger("fleetgate.kv_registry")

STREAM_MAXLEN = 1024
SNAPSHOT_EVERY = 256
DEFAULT_KV_TTL_S = 10.0
READ_COUNT = 256


def pack_keys(keys: Iterable[int]) -> bytes:
    packed = array("q", keys)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_keys(raw: bytes) -> array[int]:
    keys = array("q")
    keys.frombytes(raw)
    if sys.byteorder != "little":
        keys.byteswap()
    return keys


class _Snapshot(msgspec.Struct, array_like=True):
    gen: int
    version: int
    state: str
    reason: str
    block_size: int
    keys: bytes


class Health(Protocol):
    """What the writer publishes beside the index (workers/kv_events.py's subscriber)."""

    @property
    def state(self) -> str: ...
    @property
    def reason(self) -> str: ...


class KvIndexWriter:
    """The agent's side: publishes `index`'s changes and `health`'s state, at most once per
    `flush()` (the agent calls `run()`, which flushes every `interval_s`)."""

    def __init__(
        self, redis: aioredis.Redis, worker_id: str, index: BlockIndex, health: Health, *,
        prefix: str = DEFAULT_PREFIX, ttl_s: float = DEFAULT_KV_TTL_S,
    ) -> None:  # fmt: skip
        self.redis = redis
        self.worker_id = worker_id
        self.index = index
        self.health = health
        self.ttl_ms = int(ttl_s * 1000)
        keys = Keys(prefix)
        self.stream_key = keys.kv(worker_id)
        self.snapshot_key = keys.kv_snapshot(worker_id)
        self.gen = 0  # 0: start a generation at the next flush
        self.version = 0
        self._published: tuple[str, str, int] | None = None
        self._touched = -math.inf

    async def run(self, interval_s: float = 0.1) -> None:
        """Flush until cancelled. After a Redis error the next flush starts a new generation
        (what failed may or may not have been written); one log line per outage."""
        outage = Outage(log, "kv_registry.write_failed", "kv_registry.write_recovered", worker=self.worker_id)
        await repeat(self.flush, outage, interval_s, errors=(aioredis.RedisError, OSError), on_error=self._new_gen)

    def _new_gen(self) -> None:
        self.gen = 0

    async def flush(self) -> bool:
        """Write what changed since the last flush; whether an entry was written."""
        if not self.gen:
            await self._new_generation()
            return True
        now = time.monotonic()
        status = (self.health.state, self.health.reason, self.index.block_size)
        delta = self.index.take_delta()
        if not delta and status == self._published:
            if now - self._touched >= self.ttl_ms / 3000:
                await self._touch(now)
            return False
        self.version += 1
        entry: dict[Any, Any] = {
            "s": status[0], "r": status[1], "bs": status[2], "c": "1" if delta.cleared else "0",
            "a": pack_keys(delta.added), "d": pack_keys(delta.removed),
        }  # fmt: skip
        await self._write(entry, status, now)
        return True

    async def _new_generation(self) -> None:
        last = await self.redis.xrevrange(self.stream_key, count=1)
        newest = _id_parts(last[0][0] or b"0-0")[0] if last else 0
        self.gen = max(int(time.time() * 1000), newest + 1)
        self.version = 1
        self.index.take_delta()  # the snapshot holds everything
        status = (self.health.state, self.health.reason, self.index.block_size)
        entry: dict[Any, Any] = {"s": status[0], "r": status[1], "bs": status[2], "c": "1"}
        await self._write(entry, status, time.monotonic())
        log.info(
            "kv_registry.generation", worker=self.worker_id, gen=self.gen, blocks=len(self.index)
        )

    async def _write(self, entry: dict[Any, Any], status: tuple[str, str, int], now: float) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.xadd(
            self.stream_key,
            entry,
            id=f"{self.gen}-{self.version}",
            maxlen=STREAM_MAXLEN,
            approximate=True,
        )
        if self.version == 1 or self.version % SNAPSHOT_EVERY == 0:
            snap = _Snapshot(
                self.gen,
                self.version,
                status[0],
                status[1],
                status[2],
                pack_keys(self.index.keys()),
            )
            pipe.set(self.snapshot_key, msgspec.msgpack.encode(snap), px=self.ttl_ms)
        pipe.pexpire(self.stream_key, self.ttl_ms)
        pipe.pexpire(self.snapshot_key, self.ttl_ms)
        replies = await pipe.execute()
        self._published = status
        self._touched = now
        if not replies[-1]:  # the snapshot is gone (Redis restarted empty): a new generation
            self.gen = 0

    async def _touch(self, now: float) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.pexpire(self.stream_key, self.ttl_ms)
        pipe.pexpire(self.snapshot_key, self.ttl_ms)
        alive = await pipe.execute()
        self._touched = now
        if not all(alive):
            self.gen = 0

    async def remove(self) -> None:
        """Delete the index (the worker is going away)."""
        await self.redis.delete(self.stream_key, self.snapshot_key)


@dataclass
class WorkerKv:
    """A gateway's copy of one worker's index."""

    gen: int
    version: int
    state: str
    reason: str
    block_size: int
    keys: set[int] = field(default_factory=set)

    @property
    def usable(self) -> bool:
        """The events can be trusted (a worker with no block yet has block_size 0 and holds
        nothing: a usable answer)."""
        return self.state == "events"

    def cached_blocks(self, keys: Sequence[int]) -> int:
        """How many leading blocks of a prompt (its chain keys) the worker holds."""
        held = self.keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n


class KvMirror:
    """A gateway's in-memory copy of every worker's index, refreshed by `refresh()` in its
    background loop; the routing decision reads `get()` without touching Redis. Sets are
    updated in place between decisions (the same event loop): no copy per refresh."""

    def __init__(self, prefix: str = DEFAULT_PREFIX, absent_retry_s: float = 1.0) -> None:
        self.keys = Keys(prefix)
        self._workers: dict[str, WorkerKv] = {}
        self._absent_until: dict[str, float] = {}  # workers with no index: look again then
        self.absent_retry_s = absent_retry_s

    def get(self, worker_id: str) -> WorkerKv | None:
        """The worker's index when its events can be trusted, else None (fall back)."""
        wkv = self._workers.get(worker_id)
        return wkv if wkv is not None and wkv.usable else None

    def status(self, worker_id: str) -> WorkerKv | None:
        """The worker's index whatever its state (None: it publishes none)."""
        return self._workers.get(worker_id)

    async def run(
        self,
        redis: aioredis.Redis,
        worker_ids: Callable[[], Collection[str]],
        interval_s: float = 0.1,
    ) -> None:
        """Refresh every `interval_s` until cancelled (the gateway's background task). While
        Redis fails the copies are dropped (get() answers None): routing falls back rather
        than trust an index that no longer follows its worker."""
        outage = Outage(log, "kv_registry.read_failed", "kv_registry.read_recovered")
        await repeat(lambda: self.refresh(redis, worker_ids()), outage, interval_s,
                     errors=(aioredis.RedisError, OSError, msgspec.DecodeError, ValueError), on_error=self._forget)

    def _forget(self) -> None:
        self._workers.clear()
        self._absent_until.clear()

    async def refresh(self, redis: aioredis.Redis, worker_ids: Collection[str]) -> None:
        for gone in set(self._workers) - set(worker_ids):
            del self._workers[gone]
        for gone in set(self._absent_until) - set(worker_ids):
            del self._absent_until[gone]
        stale: list[str] = []
        if self._workers:
            streams = {
                self.keys.kv(w): f"{wkv.gen}-{wkv.version}" for w, wkv in self._workers.items()
            }
            answer = await redis.xread(streams, count=READ_COUNT)  # type: ignore[arg-type]
            by_key = {self.keys.kv(w): w for w in self._workers}
            for stream, entries in _streams(answer):
                worker = by_key[stream]
                if not self._apply(self._workers[worker], entries):
                    stale.append(worker)
        now = time.monotonic()
        stale += [
            w for w in worker_ids
            if w not in self._workers and self._absent_until.get(w, -math.inf) <= now
        ]  # fmt: skip
        if stale:
            await self._load(redis, stale, now)

    @staticmethod
    def _apply(wkv: WorkerKv, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> bool:
        """Apply the entries that follow `wkv`; False when they do not (resync)."""
        for raw_id, fields in entries:
            gen, ver = _id_parts(raw_id)
            if gen != wkv.gen or ver != wkv.version + 1:
                return False
            if fields.get(b"c") == b"1":
                wkv.keys.clear()
            wkv.keys.difference_update(unpack_keys(fields.get(b"d", b"")))
            wkv.keys.update(unpack_keys(fields.get(b"a", b"")))
            wkv.state = fields.get(b"s", b"lost").decode()
            wkv.reason = fields.get(b"r", b"").decode()
            wkv.block_size = int(fields.get(b"bs", b"0"))
            wkv.version += 1
        return True

    async def _load(self, redis: aioredis.Redis, workers: list[str], now: float) -> None:
        raws = await redis.mget([self.keys.kv_snapshot(w) for w in workers])
        for worker, raw in zip(workers, raws, strict=True):
            if raw is None:  # no index (an engine without events) or not written yet
                self._workers.pop(worker, None)
                self._absent_until[worker] = now + self.absent_retry_s
                continue
            snap = msgspec.msgpack.decode(
                raw if isinstance(raw, bytes) else raw.encode(), type=_Snapshot
            )
            self._absent_until.pop(worker, None)
            self._workers[worker] = WorkerKv(
                gen=snap.gen, version=snap.version, state=snap.state, reason=snap.reason,
                block_size=snap.block_size, keys=set(unpack_keys(snap.keys)),
            )  # fmt: skip


def _id_parts(raw_id: bytes | str) -> tuple[int, int]:
    """(gen, version) of a stream entry id "<gen>-<version>"."""
    text = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
    gen, _, ver = text.partition("-")
    return int(gen), int(ver)


def _streams(answer: Any) -> list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREAD's answer as [(stream key, entries)]: a list of pairs in RESP2, a map in RESP3."""
    if not answer:
        return []
    pairs = answer.items() if isinstance(answer, dict) else answer
    return [(k.decode() if isinstance(k, bytes) else k, entries) for k, entries in pairs]
