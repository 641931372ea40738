"""Adapter placement: put LoRA adapters where requests need them, and take cold ones away.

When no ready worker holds a requested adapter, the best worker that can load it
(its engine loads adapters at runtime, it serves the adapter's base model, it is
routable) loads it through the engine's API; one load per adapter at a time in the whole
fleet (a lock in Redis), other requests for it wait for that load. An adapter whose every
replica is busy gets one more replica, in the background, checked as each request starts
(so a burst gets it before a queue builds). A worker with no free adapter slot first
unloads its least recently used adapter (by every gateway's use, shared through Redis:
gateway/accounts/lora_state.py) that no gateway has a request in flight for; when each one has,
the new adapter is loaded beside them (the engine swaps it in and out, slower) rather
than cutting a stream. Each change is written to the registry at once, so every gateway
routes to the new placement. Adapters an operator adds through the admin API are kept in
Redis: every replica, and a gateway that restarts, can place them.

Routing reads `residency`: where an adapter is live (by every gateway's requests in flight
and the engines' own reports), and where every LoRA slot is taken by others, or where a second
copy of it would take the slot of an adapter still in demand (gateway/accounts/lora_state.py). A request
whose adapter would find every slot busy is held in the gateway by the slot gate first
(gateway/request/retries.py); one sent so anyway (the gate off, or its wait ran out) waits in the
engine for one; each is counted (`slot_waits`, fleetgate_adapter_slot_waits_total) and logged,
never hidden.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import msgspec
import structlog
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.exceptions import RedisError

from fleetgate.registry import Registry
from fleetgate.schema import WorkerView
from gateway.accounts.inflight import SharedInflight
from gateway.accounts.lora_state import LoraState, residency, slot_wait, still_reported
from gateway.engines.upstream import Upstream
from gateway.errors import InvalidRequest, NoWorkerAvailable, UpstreamError
from gateway.fleet import FleetWatcher
from gateway.settings import AdapterSpec

log = structlog.get_logger("gateway.adapters")

_spec_decoder = msgspec.json.Decoder(AdapterSpec)
# The longest one load may hold the fleet-wide lock (an engine's load answers in seconds).
_LOAD_LOCK_S = 120.0


class AdapterPlacer:
    def __init__(
        self,
        specs: dict[str, AdapterSpec],
        watcher: FleetWatcher,
        registry: Registry,
        inflight: SharedInflight,
        state: LoraState,
        upstream: Upstream,
        replicate_at: float = 0.75,
        replicate_every_s: float = 5.0,
        specs_every_s: float = 2.0,
    ) -> None:
        self.specs = specs
        self.watcher = watcher
        self.registry = registry
        self.inflight = inflight
        self.state = state
        self.upstream = upstream  # the engines' one client: loads and unloads go through it
        # Every replica busier than this (outstanding / capacity) asks for another replica.
        self.replicate_at = replicate_at
        self.replicate_every_s = replicate_every_s
        self.specs_every_s = specs_every_s
        self.loads = 0
        # Requests sent where every LoRA slot was live with other adapters (they wait in the
        # engine for one), per adapter.
        self.slot_waits: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._worker_locks: dict[str, asyncio.Lock] = {}
        self._replicated_at: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def known(self, model: str) -> bool:
        return model in self.specs

    # -- the request path -------------------------------------------------------

    async def ensure(self, model: str) -> None:
        """Make sure some routable worker serves `model` (loading it if needed)."""
        if self._served(model):
            return
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            if self._served(model):  # someone else's load finished while we waited
                return
            async with self._fleet_lock(model, wait=True) as held:
                if self._served(model):  # another gateway's load finished
                    return
                target = self._pick(model)
                if target is None:
                    raise NoWorkerAvailable(
                        f"No worker can load adapter `{model}` now (none serves its base model "
                        f"`{self.specs[model].base}` with runtime adapter loading).", retry_after=1,
                    )
                if not held:
                    raise NoWorkerAvailable(f"Adapter `{model}` is being loaded; try again shortly.",
                                            retry_after=1)
                await self._load(target, model)

    def residency(self, model: str, recent_s: float = 30.0) -> tuple[frozenset[str], frozenset[str]]:
        """(workers where `model` is live, or was last sent within `recent_s` with a slot still
        free; workers to keep it from: no slot for it, fewer free than another, or no slot to
        spare in the fleet for another copy of it), for routing (gateway/accounts/lora_state.residency)."""
        routes = self.watcher.snapshot.routes.by_model.get(model)
        if routes is None:
            return frozenset(), frozenset()
        return residency(routes.slots, model, self.state, time.time(), recent_s)

    def started(self, worker_id: str, model: str) -> None:
        """A request for adapter `model` goes to `worker_id` now: count it, and add a replica
        when every worker serving the adapter is busy (this request included)."""
        self._count_slot_wait(worker_id, model)
        self.state.started(worker_id, model)
        if not self.known(model):
            return
        now = time.monotonic()
        if now - self._replicated_at.get(model, 0.0) < self.replicate_every_s:
            return
        routes = self.watcher.snapshot.routes.by_model.get(model)
        if routes is None:
            return
        get = self.inflight.get
        serving = [s for s in routes.slots if s.routable]
        if not serving or any(
            max(get(s.id, 0), s.engine_busy) / s.capacity < self.replicate_at for s in serving
        ):
            return
        target = self._pick(model)
        if target is None:
            return
        self._replicated_at[model] = now
        task = asyncio.create_task(self._replicate(target, model))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def finished(self, worker_id: str, model: str) -> None:
        self.state.finished(worker_id, model)

    def _count_slot_wait(self, worker_id: str, model: str) -> None:
        routes = self.watcher.snapshot.routes.by_model.get(model)
        slot = next((s for s in routes.slots if s.id == worker_id), None) if routes is not None else None
        if slot is None or not (holders := slot_wait(slot, model, self.state)):
            return
        self.slot_waits[model] = self.slot_waits.get(model, 0) + 1
        log.debug("gateway.adapter_slot_wait", worker=worker_id, adapter=model, live=holders, slots=slot.max_loras)

    # -- choosing and loading -----------------------------------------------------

    def _served(self, model: str) -> bool:
        routes = self.watcher.snapshot.routes.by_model.get(model)
        return routes is not None and any(s.routable for s in routes.slots)

    def _pick(self, model: str) -> WorkerView | None:
        """The least busy routable worker that can load `model`: a free slot first, then a
        slot whose adapter is idle, then (no eviction: the engine swaps) any."""
        spec = self.specs[model]
        routes = self.watcher.snapshot.routes.by_model.get(spec.base)
        if routes is None:
            return None
        get = self.inflight.get
        best: tuple[float, str, WorkerView] | None = None
        for slot in routes.slots:
            view = slot.view
            info = view.info
            if not slot.routable or not info.runtime_lora or info.max_loras <= 0 or model in info.adapters:
                continue
            full = 0.0 if len(info.adapters) < info.max_loras else 1.0 if self._coldest(view) else 2.0
            score = full + max(get(slot.id, 0), slot.engine_busy) / slot.capacity
            if best is None or (score, slot.id) < best[:2]:
                best = (score, slot.id, view)
        return best[2] if best else None

    @contextlib.asynccontextmanager
    async def _fleet_lock(self, model: str, wait: bool) -> AsyncIterator[bool]:
        """The fleet-wide lock on loading `model`: yields whether it is held. With `wait`,
        waits (up to a load's time) for another gateway's load, then tries again."""
        owner = self.state.gateway_id
        deadline = time.monotonic() + _LOAD_LOCK_S
        held = await self._try_lock(model, owner)
        while not held and wait and time.monotonic() < deadline and not self._served(model):
            await asyncio.sleep(0.1)
            held = await self._try_lock(model, owner)
        try:
            yield held
        finally:
            if held:
                with contextlib.suppress(Exception):
                    await self.registry.unlock_adapter(model, owner)

    async def _try_lock(self, model: str, owner: str) -> bool:
        try:
            return await self.registry.lock_adapter(model, owner, _LOAD_LOCK_S)
        except (RedisError, OSError) as exc:  # no registry: this gateway's own lock must do
            log.warning("gateway.adapter_lock_unavailable", adapter=model, error=repr(exc))
            return True

    async def _replicate(self, target: WorkerView, model: str) -> None:
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            with contextlib.suppress(Exception):
                async with self._fleet_lock(model, wait=False) as held:
                    fresh = self.watcher.snapshot.by_id.get(target.id)
                    if held and fresh is not None and model not in fresh.info.adapters:
                        await self._load(fresh, model)

    async def _load(self, worker: WorkerView, model: str) -> None:
        started = time.monotonic()
        # Loads of different adapters onto one worker take turns, each on the worker's record
        # as it is now: two at once would each write the adapter list they started from.
        async with self._worker_locks.setdefault(worker.id, asyncio.Lock()):
            worker = await self._fresh(worker)
            info = worker.info
            if model in info.adapters:  # another gateway loaded it meanwhile
                await self.watcher.refresh()
                return
            evicted: list[str] = []
            if len(info.adapters) >= info.max_loras:
                with contextlib.suppress(RedisError, OSError):  # the last sync's counts must do
                    await self.state.refresh_remote()
                # Down to a free slot: also what an earlier oversubscribed load left behind.
                while len(info.adapters) - len(evicted) >= info.max_loras and (
                        victim := self._coldest(worker, skip=evicted)):
                    await self._post(worker, "/v1/unload_lora_adapter", {"lora_name": victim})
                    evicted.append(victim)
                if len(info.adapters) - len(evicted) >= info.max_loras:
                    log.info("gateway.adapter_oversubscribed", worker=info.id, adapter=model,
                             in_use=[a for a in info.adapters if a not in evicted], max_loras=info.max_loras)
            spec = self.specs[model]
            await self._post(worker, "/v1/load_lora_adapter", {"lora_name": model, "lora_path": spec.path})
            self.loads += 1
            await self._write_adapters(worker, add=model, remove=evicted)
        log.info("gateway.adapter_loaded", worker=info.id, adapter=model, evicted=",".join(evicted) or None,
                 ms=round((time.monotonic() - started) * 1000, 1))

    async def _fresh(self, worker: WorkerView) -> WorkerView:
        """The worker's record as the registry holds it now (another gateway may have changed it)."""
        try:
            return await self.registry.read(worker.id) or worker
        except (RedisError, OSError):
            return self.watcher.snapshot.by_id.get(worker.id, worker)

    async def _write_adapters(self, worker: WorkerView, add: str = "", remove: Sequence[str] = ()) -> None:
        """Record an adapter loaded on (or others removed from) the worker, on its freshest record."""
        info = (await self._fresh(worker)).info
        adapters = [a for a in info.adapters if a != add and a not in remove] + ([add] if add else [])
        await self.registry.update_info(msgspec.structs.replace(info, adapters=tuple(adapters)))
        await self.watcher.refresh()

    def _coldest(self, worker: WorkerView, skip: Sequence[str] = ()) -> str:
        """The least recently used adapter on the worker that no gateway has a request in
        flight for and its engine is not running ("" when there is none); one the worker
        was started with only when no adapter the gateway placed qualifies. Not running: by
        the engine's last report as routing reads it (`still_reported`: an adapter a gateway
        finished with there after the report is not running, whatever the report says)."""
        state = self.state
        busy = still_reported(worker.id, worker.load.lora_active, worker.load.ts, state.last_used)
        idle = [a for a in worker.info.adapters
                if a not in busy and a not in skip and not state.in_flight(worker.id, a)]
        candidates = [a for a in idle if a in self.specs] or idle
        if not candidates:
            return ""
        return min(candidates, key=lambda a: (state.last_used(worker.id, a), a))

    async def _post(self, worker: WorkerView, path: str, body: dict[str, str], operator: bool = False) -> None:
        try:
            status, data = await self.upstream.post_json(worker.info.url + path, body, 120.0)
        except UpstreamError as exc:
            raise UpstreamError(f"{path} on {worker.id} failed: {exc.message}") from exc
        text = data.decode(errors="replace")
        if status == 400 and "already been loaded" in text:
            return
        if operator and 400 <= status < 500:  # the engine refused the operator's adapter or path
            raise InvalidRequest(f"Worker `{worker.id}`'s engine refused {path} ({status}): {text[:200]}",
                                 code="adapter_refused")
        if status != 200:
            raise UpstreamError(f"{path} on {worker.id} answered {status}: {text[:200]}")

    # -- admin ------------------------------------------------------------------------

    async def load_on(self, worker: WorkerView, name: str, path: str | None) -> None:
        if path is None:
            if name not in self.specs:
                raise KeyError(name)
            path = self.specs[name].path
        await self._post(worker, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, operator=True)
        if name not in self.specs or self.specs[name].path != path:
            spec = AdapterSpec(path=path, base=worker.info.model)
            # Kept in Redis: every replica, and this gateway after a restart, can place it.
            await self.registry.save_adapter(name, msgspec.json.encode(spec))
            self._learn({name: spec})
        async with self._worker_locks.setdefault(worker.id, asyncio.Lock()):
            await self._write_adapters(worker, add=name)

    async def unload_from(self, worker: WorkerView, name: str) -> None:
        async with self._worker_locks.setdefault(worker.id, asyncio.Lock()):
            await self._post(worker, "/v1/unload_lora_adapter", {"lora_name": name}, operator=True)
            await self._write_adapters(worker, remove=(name,))

    # -- adapters added through the admin API, shared by every replica ---------------------

    def _learn(self, specs: dict[str, AdapterSpec]) -> None:
        self.specs = {**self.specs, **specs}
        self.watcher.loadable.update({name: spec.base for name, spec in specs.items()})
        self.watcher.poke()

    async def restore(self) -> None:
        """Learn the adapters operators added (through any gateway) from Redis."""
        fresh: dict[str, AdapterSpec] = {}
        for name, raw in (await self.registry.read_adapters()).items():
            try:
                spec = _spec_decoder.decode(raw)
            except msgspec.DecodeError:
                continue
            if self.specs.get(name) != spec:
                fresh[name] = spec
        if fresh:
            self._learn(fresh)
            log.info("gateway.adapters_restored", adapters=sorted(fresh))

    def start(self) -> None:
        task = asyncio.create_task(self._specs_loop(), name="adapter-specs")
        self._tasks.add(task)

    async def _specs_loop(self) -> None:
        while True:
            await asyncio.sleep(self.specs_every_s)
            try:
                await self.restore()
            except Exception as exc:  # Redis away: the specs known so far still serve
                log.debug("gateway.adapters_restore_failed", error=repr(exc))

    def collector(self) -> Collector:
        """Its counters for the gateway's /metrics."""
        return _PlacerCollector(self)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class _PlacerCollector(Collector):
    def __init__(self, placer: AdapterPlacer) -> None:
        self.placer = placer

    def collect(self) -> Iterator[Metric]:
        waits = CounterMetricFamily(
            "fleetgate_adapter_slot_waits", "Adapter requests sent to an engine whose every LoRA slot "
            "was live with other adapters (they wait in the engine for a slot), by adapter.", labels=["adapter"])
        for adapter, n in sorted(self.placer.slot_waits.items()):
            waits.add_metric([adapter], n)
        yield waits
        state = self.placer.state
        holds = CounterMetricFamily(
            "fleetgate_adapter_slot_holds", "Adapter requests the gateway held while their engine's LoRA slots "
            "were busy with other adapters (the slot gate), by adapter and why (slot: none free; turn: the "
            "adapter's turn there was up while others waited).", labels=["adapter", "why"])
        for (adapter, why), n in sorted(state.slot_holds.items()):
            holds.add_metric([adapter, why], n)
        yield holds
        late = CounterMetricFamily(
            "fleetgate_adapter_slot_hold_timeouts", "Held adapter requests sent at lora_slot_wait_max_s with "
            "their engine's slots still busy.", labels=["adapter"])
        for adapter, n in sorted(state.slot_hold_timeouts.items()):
            late.add_metric([adapter], n)
        yield late
        loads = CounterMetricFamily("fleetgate_adapter_loads", "Adapters this gateway loaded onto engines.")
        loads.add_metric([], self.placer.loads)
        yield loads
