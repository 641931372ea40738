"""LoRA placement state that every gateway replica shares: adapter requests in flight per
(worker, adapter), and when each adapter was last sent to each worker (the LRU evictions
follow).

The request path only touches local dicts (`started`, `finished`); a background task
publishes them about five times a second, and at once when an adapter comes into use on
a worker (the counts under a lease, like gateway/inflight.py's, so a crashed gateway leaks
nothing), and reads the other replicas'; a gateway about to evict reads them afresh.
An adapter is evictable from a worker only when no gateway has a request for it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import structlog

from fleetgate.registry import Registry

log = structlog.get_logger("gateway.lora_state")


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
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- the request path ----------------------------------------------------------

    def started(self, worker_id: str, adapter: str) -> None:
        key = (worker_id, adapter)
        n = self.local.get(key, 0)
        self.local[key] = n + 1
        self.touch(worker_id, adapter)
        if n == 0:  # an adapter newly in use there: the other replicas hear of it at once
            self._wake.set()

    def finished(self, worker_id: str, adapter: str) -> None:
        key = (worker_id, adapter)
        left = self.local.get(key, 1) - 1
        if left > 0:
            self.local[key] = left
        else:
            self.local.pop(key, None)
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

    def slots(self, worker_id: str, within_s: float) -> dict[str, float]:
        """Adapters sent to `worker_id` in the last `within_s` seconds -> when."""
        cutoff = time.time() - within_s
        return {a: t for (w, a), t in self.used.items() if w == worker_id and t >= cutoff}

    # -- background sync --------------------------------------------------------------

    def start(self, workers: Callable[[], list[str]]) -> None:
        self._task = asyncio.create_task(self._loop(workers), name="lora-state-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

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
        failing = False
        while True:
            try:
                await self.sync(workers())
                if failing:
                    log.info("gateway.lora_state_sync_resumed")
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not failing:
                    log.warning("gateway.lora_state_sync_failed", error=repr(exc))
                failing = True
                if time.monotonic() - self._remote_at > self.lease_s:
                    self.remote.clear()  # the other replicas' counts expire with their lease
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            self._wake.clear()


__all__ = ["LoraState"]
