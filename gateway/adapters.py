"""Adapter placement: put LoRA adapters where requests need them, and take cold ones away.

When no ready worker holds a requested adapter, the best worker that can load it
(its engine loads adapters at runtime, it serves the adapter's base model, it is
routable) loads it through the engine's API; one load per adapter at a time, other
requests for it wait for that load. An adapter whose every replica is busy gets one
more replica, in the background. A worker with no free adapter slot first unloads
its least recently used adapter that has nothing in flight. Each change is written
to the registry at once, so every gateway routes to the new placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict

import aiohttp
import msgspec
import structlog

from fleetgate.registry import Registry
from fleetgate.schema import WorkerView
from gateway.errors import NoWorkerAvailable, UpstreamError
from gateway.fleet import FleetWatcher
from gateway.inflight import SharedInflight
from gateway.settings import AdapterSpec

log = structlog.get_logger("gateway.adapters")


class AdapterPlacer:
    def __init__(
        self,
        specs: dict[str, AdapterSpec],
        watcher: FleetWatcher,
        registry: Registry,
        inflight: SharedInflight,
        replicate_at: float = 0.75,
        replicate_every_s: float = 5.0,
    ) -> None:
        self.specs = specs
        self.watcher = watcher
        self.registry = registry
        self.inflight = inflight
        # Every replica busier than this (outstanding / capacity) asks for another replica.
        self.replicate_at = replicate_at
        self.replicate_every_s = replicate_every_s
        self.loads = 0
        self.last_used: dict[tuple[str, str], float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._replicated_at: dict[str, float] = {}
        # Per worker, the adapters this gateway sent there, least recently first: the
        # engine keeps the last `max_loras` of them in its slots (vLLM evicts LRU).
        self._slots: dict[str, OrderedDict[str, float]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.session: aiohttp.ClientSession | None = None

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
            target = self._pick(model)
            if target is None:
                raise NoWorkerAvailable(
                    f"No worker can load adapter `{model}` now (none serves its base model "
                    f"`{self.specs[model].base}` with runtime adapter loading).", retry_after=1,
                )
            await self._load(target, model)

    def residency(self, model: str, within_s: float = 60.0) -> tuple[frozenset[str], frozenset[str]]:
        """(workers where `model` is likely in a LoRA slot, workers whose slots are likely all
        taken), from what this gateway sent where in the last `within_s` seconds. The
        engines' own reports (running and waiting adapters) come on top, in the policy."""
        cutoff = time.monotonic() - within_s
        warm, full = [], []
        by_id = self.watcher.snapshot.by_id
        for worker_id, slots in self._slots.items():
            at = slots.get(model)
            if at is not None and at >= cutoff:
                warm.append(worker_id)
                continue
            view = by_id.get(worker_id)
            if view is not None and view.info.max_loras > 0:
                recent = sum(1 for t in slots.values() if t >= cutoff)
                if recent >= view.info.max_loras:
                    full.append(worker_id)
        return frozenset(warm), frozenset(full)

    def routed(self, worker_id: str, model: str) -> None:
        """A request for adapter `model` went to `worker_id`: note it, and maybe add a replica."""
        now = time.monotonic()
        self.last_used[(worker_id, model)] = now
        slots = self._slots.setdefault(worker_id, OrderedDict())
        slots[model] = now
        slots.move_to_end(model)
        view = self.watcher.snapshot.by_id.get(worker_id)
        keep = view.info.max_loras if view is not None and view.info.max_loras > 0 else 16
        while len(slots) > keep:
            slots.popitem(last=False)
        if not self.known(model):
            return
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

    # -- choosing and loading -----------------------------------------------------

    def _served(self, model: str) -> bool:
        routes = self.watcher.snapshot.routes.by_model.get(model)
        return routes is not None and any(s.routable for s in routes.slots)

    def _pick(self, model: str) -> WorkerView | None:
        """The least busy routable worker that can load `model`, preferring a free slot."""
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
            full = len(info.adapters) >= info.max_loras
            score = (1.0 if full else 0.0) + max(get(slot.id, 0), slot.engine_busy) / slot.capacity
            if best is None or (score, slot.id) < best[:2]:
                best = (score, slot.id, view)
        return best[2] if best else None

    async def _replicate(self, target: WorkerView, model: str) -> None:
        lock = self._locks.setdefault(model, asyncio.Lock())
        async with lock:
            with contextlib.suppress(Exception):
                await self._load(target, model)

    async def _load(self, worker: WorkerView, model: str) -> None:
        started = time.monotonic()
        info = worker.info
        adapters = list(info.adapters)
        evicted = ""
        if len(adapters) >= info.max_loras:
            evicted = self._coldest(worker)
            if evicted:
                await self._post(worker, "/v1/unload_lora_adapter", {"lora_name": evicted})
                adapters.remove(evicted)
        spec = self.specs[model]
        await self._post(worker, "/v1/load_lora_adapter", {"lora_name": model, "lora_path": spec.path})
        adapters.append(model)
        self.loads += 1
        await self.registry.update_info(msgspec.structs.replace(info, adapters=tuple(adapters)))
        await self.watcher.refresh()
        log.info("gateway.adapter_loaded", worker=info.id, adapter=model, evicted=evicted or None,
                 ms=round((time.monotonic() - started) * 1000, 1))

    def _coldest(self, worker: WorkerView) -> str:
        """The least recently used adapter on the worker (never one it was started with... if avoidable)."""
        candidates = [a for a in worker.info.adapters if a in self.specs] or list(worker.info.adapters)
        if not candidates:
            return ""
        return min(candidates, key=lambda a: (self.last_used.get((worker.id, a), 0.0), a))

    async def _post(self, worker: WorkerView, path: str, body: dict[str, str]) -> None:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        url = worker.info.url + path
        try:
            async with self.session.post(url, json=body) as resp:
                text = await resp.text()
                if resp.status == 400 and "already been loaded" in text:
                    return
                if resp.status != 200:
                    raise UpstreamError(f"{path} on {worker.id} answered {resp.status}: {text[:200]}")
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{path} on {worker.id} failed: {type(exc).__name__}") from exc

    # -- admin ------------------------------------------------------------------------

    async def load_on(self, worker: WorkerView, name: str, path: str | None) -> None:
        if path is None:
            if name not in self.specs:
                raise KeyError(name)
            path = self.specs[name].path
        else:
            self.specs = {**self.specs, name: AdapterSpec(path=path, base=worker.info.model)}
        await self._post(worker, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
        adapters = tuple(dict.fromkeys((*worker.info.adapters, name)))
        await self.registry.update_info(msgspec.structs.replace(worker.info, adapters=adapters))
        await self.watcher.refresh()

    async def unload_from(self, worker: WorkerView, name: str) -> None:
        await self._post(worker, "/v1/unload_lora_adapter", {"lora_name": name})
        adapters = tuple(a for a in worker.info.adapters if a != name)
        await self.registry.update_info(msgspec.structs.replace(worker.info, adapters=adapters))
        await self.watcher.refresh()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.session is not None:
            await self.session.close()
