"""The gateway's live view of the fleet: an immutable snapshot, refreshed in the background.

The request path only reads `FleetWatcher.snapshot` (an attribute load); it never
waits on Redis. The watcher re-reads the registry when a pub/sub event arrives and
at least every `refresh_interval_s`. While Redis is unreachable it keeps serving
the last snapshot, marks itself degraded and reconnects with backoff. When Redis comes
back without the fleet's records (a restart that lost them), or after an outage or a
Sentinel failover long enough for records to expire before their agents could heartbeat,
workers missing from it are kept for `resync_grace_s`, until their agents register again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec
import structlog
from redis.exceptions import ResponseError

from fleetgate.background import Outage, stop_tasks
from fleetgate.registry import Registry, out_of_memory
from fleetgate.schema import WorkerView
from gateway.errors import GatewayError
from gateway.models.known import KnownModels
from gateway.routing.table import Routes
from gateway.subscription import follow

log = structlog.get_logger("gateway.fleet")

# A read this much later than the refresh interval means Redis was out of reach meanwhile.
OUTAGE_S = 1.0


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    workers: tuple[WorkerView, ...] = ()
    by_id: Mapping[str, WorkerView] = field(default_factory=dict)
    version: int = 0
    read_at: float = 0.0
    # Every model name the ready fleet serves -> its base model ("" for a base model).
    models: Mapping[str, str] = field(default_factory=dict)
    models_json: bytes = b'{"object":"list","data":[]}'
    routes: Routes = field(default_factory=lambda: Routes({}))

    @classmethod
    def build(
        cls, workers: list[WorkerView], version: int, loadable: Mapping[str, str] | None = None
    ) -> FleetSnapshot:
        """`loadable`: adapters (-> base model) the gateway can load onto runtime-LoRA workers."""
        models: dict[str, str] = {}
        created: dict[str, int] = {}
        runtime_bases: set[str] = set()
        for w in workers:
            if w.state == "starting":
                continue
            models.setdefault(w.info.model, "")
            created.setdefault(w.info.model, int(w.info.started_at))
            if w.info.runtime_lora and w.info.max_loras > 0:
                runtime_bases.add(w.info.model)
            for adapter in w.info.adapters:
                models.setdefault(adapter, w.info.model)
                created.setdefault(adapter, int(w.info.started_at))
        for adapter, base in (loadable or {}).items():
            if base in runtime_bases and adapter not in models:
                models[adapter] = base
                created[adapter] = created[base]
        data = [
            {
                "id": name, "object": "model", "created": created[name],
                "owned_by": "fleetgate", **({"parent": parent} if parent else {"parent": None}),
            }
            for name, parent in sorted(models.items(), key=lambda kv: (kv[1], kv[0]))
        ]
        return cls(
            workers=tuple(workers),
            by_id={w.id: w for w in workers},
            version=version,
            read_at=time.time(),
            models=models,
            models_json=msgspec.json.encode({"object": "list", "data": data}),
            routes=Routes.build(workers),
        )


class FleetWatcher:
    def __init__(
        self, registry: Registry, refresh_interval_s: float = 1.0, loadable: Mapping[str, str] | None = None,
        known: KnownModels | None = None,
    ) -> None:
        self.registry = registry
        self.known = known or KnownModels()
        self.loadable = dict(loadable or {})
        self.refresh_interval_s = refresh_interval_s
        self.snapshot = FleetSnapshot()
        self.degraded = True
        self.last_error = ""
        self._version = 0
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = asyncio.Event()
        # After Redis lost its data, or was out of reach long enough for records to expire
        # (a Sentinel failover), workers missing from it are kept this long (until their
        # agents, heartbeating every second, have registered again).
        self.resync_grace_s = registry.ttl_ms / 1000 + 2.0
        self._keep_until = 0.0
        self._read_at = 0.0  # monotonic time of the last successful read
        # Worker id -> (when its agent was last told its record is ignored, when it was logged).
        self._told: dict[str, tuple[float, float]] = {}
        # Called with the workers of every new snapshot (the in-flight account resets what
        # each new engine report covers).
        self._listeners: list[Callable[[Sequence[WorkerView]], None]] = []
        # Responses API answers whose worker could not be recorded (gateway/request/responses.py): said
        # once while Redis is away or full, not once per answer.
        self.unrecorded = Outage(structlog.get_logger("gateway.responses"), "gateway.response_not_recorded",
                                 "gateway.responses_recorded")

    def on_refresh(self, listener: Callable[[Sequence[WorkerView]], None]) -> None:
        """Call `listener` with the workers of each new snapshot, the current one first."""
        self._listeners.append(listener)
        listener(self.snapshot.workers)

    def current(self) -> FleetSnapshot:
        """The snapshot now (for those that hold the reader, not the watcher)."""
        return self.snapshot

    @property
    def age_s(self) -> float:
        return time.time() - self.snapshot.read_at if self.snapshot.read_at else float("inf")

    async def start(self, wait_s: float = 2.0) -> None:
        self._tasks = [
            asyncio.create_task(self._refresh_loop(), name="fleet-refresh"),
            asyncio.create_task(self._listen_loop(), name="fleet-listen"),
        ]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), wait_s)

    async def stop(self) -> None:
        await stop_tasks(*self._tasks)

    def absent(self, error: GatewayError, model: str) -> GatewayError:
        """What to answer instead of `error` (a 404) for a model no worker serves now."""
        return self.known.absent(
            model, registry_read=bool(self.snapshot.read_at), registry_up=not self.degraded
        ) or error

    def poke(self) -> None:
        """Ask for a re-read now (after an admin write, say)."""
        self._wake.set()

    async def refresh(self) -> None:
        moved = await self.registry.follow_master()
        rejected: dict[str, str] = {}
        workers = await self.registry.read_all(rejected)
        if rejected:
            await self._rejected(rejected)
        if await self._lost_data() and self.snapshot.workers:
            log.warning("gateway.registry_lost_data", keep_s=self.resync_grace_s,
                        workers=len(self.snapshot.workers))
            self._keep_until = time.monotonic() + self.resync_grace_s
        now = time.monotonic()
        unreachable_s = now - self._read_at if self._read_at else 0.0
        if self.snapshot.workers and (moved or unreachable_s > self.refresh_interval_s + OUTAGE_S):
            # Agents could not heartbeat either (Redis away, a read that retried through a
            # failover, a master that moved): records may have expired under them on the new
            # master, until each agent's next heartbeat registers it again.
            log.warning("gateway.registry_resync", master_moved=moved, unreachable_s=round(unreachable_s, 2),
                        keep_s=self.resync_grace_s, workers=len(self.snapshot.workers))
            self._keep_until = now + self.resync_grace_s
        self._read_at = now
        if now < self._keep_until:
            present = {w.id for w in workers}
            workers += [w for w in self.snapshot.workers if w.id not in present]
        self._version += 1
        old = self.snapshot
        self.snapshot = FleetSnapshot.build(workers, self._version, self.loadable)
        # Starting workers' models count too: a model about to be served is not unknown.
        self.known.note([*self.snapshot.models, *(n for w in workers for n in (w.info.model, *w.info.adapters))])
        if self.degraded:
            log.info("gateway.registry_connected", workers=len(workers))
        self.degraded = False
        self.last_error = ""
        self._ready.set()
        for listener in self._listeners:
            listener(self.snapshot.workers)
        _log_changes(old, self.snapshot)

    async def _lost_data(self) -> bool:
        """Whether Redis lost the fleet's state (registry.mark_epoch). A Redis at maxmemory
        (noeviction) cannot take the mark, but reads still work: the fleet is read all the same
        (a Redis that restarted empty is not full)."""
        try:
            return await self.registry.mark_epoch()
        except ResponseError as exc:
            if out_of_memory(exc):
                return False
            raise

    async def _rejected(self, rejected: dict[str, str]) -> None:
        """Records not signed with the registration secret are ignored. Say so: in the log once a
        minute per worker, and to its agent (a registry key it reads) every few seconds."""
        now = time.monotonic()
        for worker_id, why in rejected.items():
            told, logged = self._told.get(worker_id, (-1e9, -1e9))
            if now - logged >= 60:
                logged = now
                log.warning("gateway.worker_rejected", worker=worker_id, reason=why,
                            hint="give its agent this fleet's FLEETGATE_REGISTRATION_SECRET")
            if now - told >= 2:
                told = now
                await self.registry.reject(worker_id, why)
            self._told[worker_id] = (told, logged)
        for worker_id in [w for w, (_, at) in self._told.items() if now - at > 120]:
            del self._told[worker_id]

    async def _refresh_loop(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self.refresh()
                backoff = 0.1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.refresh_interval_s)
                self._wake.clear()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self.degraded:
                    log.warning("gateway.registry_unreachable", error=repr(exc))
                self.degraded = True
                self.last_error = repr(exc)
                await asyncio.sleep(backoff)
                # At most a refresh interval: a promoted replica is read as soon as it answers.
                backoff = min(backoff * 2, self.refresh_interval_s)

    async def _listen_loop(self) -> None:
        # Like the re-reads: subscribed again within a refresh interval of Redis being back.
        await follow(self.registry.subscribe, self._wake, lambda: self.refresh_interval_s)


def _log_changes(old: FleetSnapshot, new: FleetSnapshot) -> None:
    for wid, w in new.by_id.items():
        before = old.by_id.get(wid)
        if before is None:
            log.info("gateway.worker_seen", worker=wid, state=w.effective_state, url=w.info.url)
        elif before.effective_state != w.effective_state:
            log.info("gateway.worker_state", worker=wid, state=w.effective_state)
    for wid in old.by_id.keys() - new.by_id.keys():
        log.info("gateway.worker_gone", worker=wid)
