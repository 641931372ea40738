"""Per-worker circuit breakers, shared by every gateway through Redis.

A worker that fails `threshold` attempts in a row (connection refused, timeout,
5xx, a stream that broke) is taken out of routing on every gateway: the gateway
that saw it writes `circuit:<id>` with a cooldown TTL. That gateway then probes
the worker's health; a healthy answer closes the circuit at once, a failed one
renews it with a doubled cooldown. If nobody probes (that gateway died), the key
simply expires and the worker gets traffic again: half-open, one failure away from
opening again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp
import structlog

from fleetgate.registry import Registry
from fleetgate.schema import WorkerView

log = structlog.get_logger("gateway.circuit")


class Breakers:
    def __init__(
        self,
        registry: Registry,
        lookup: Callable[[str], WorkerView | None],
        on_change: Callable[[], None],
        threshold: int = 3,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
    ) -> None:
        self.registry = registry
        self.lookup = lookup
        self.on_change = on_change
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.failures: dict[str, int] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}
        self.session: aiohttp.ClientSession | None = None

    def success(self, worker_id: str) -> None:
        if self.failures:
            self.failures.pop(worker_id, None)

    def failure(self, worker_id: str, reason: str) -> None:
        n = self.failures.get(worker_id, 0) + 1
        self.failures[worker_id] = n
        if n >= self.threshold and worker_id not in self._probes:
            self._probes[worker_id] = asyncio.create_task(
                self._open_and_probe(worker_id, reason), name=f"circuit-{worker_id}"
            )

    async def _open_and_probe(self, worker_id: str, reason: str) -> None:
        cooldown = self.cooldown_s
        try:
            while True:
                why = f"{self.failures.get(worker_id, 0)} failures in a row, last: {reason}"[:300]
                try:
                    await self.registry.open_circuit(worker_id, why, cooldown)
                except Exception as exc:
                    log.warning("gateway.circuit_write_failed", worker=worker_id, error=repr(exc))
                self.on_change()
                log.warning("gateway.circuit_open", worker=worker_id, reason=why, cooldown_s=cooldown)
                await asyncio.sleep(cooldown * 0.8)
                worker = self.lookup(worker_id)
                if worker is None:
                    return  # it left the fleet
                if await self._healthy(worker):
                    with contextlib.suppress(Exception):
                        await self.registry.close_circuit(worker_id)
                    self.failures.pop(worker_id, None)
                    self.on_change()
                    log.info("gateway.circuit_closed", worker=worker_id)
                    return
                reason = "health probe failed"
                cooldown = min(cooldown * 2, self.max_cooldown_s)
        finally:
            self._probes.pop(worker_id, None)

    async def _healthy(self, worker: WorkerView) -> bool:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3))
        try:
            async with self.session.get(worker.info.url + "/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        for task in list(self._probes.values()):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()
