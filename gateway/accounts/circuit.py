"""Per-worker circuit breakers, shared by every gateway through Redis.

A worker that fails `threshold` attempts in a row (connection refused, timeout,
5xx, a stream that broke) is taken out of routing on every gateway: the gateway
that saw it writes `circuit:<id>` with a cooldown TTL. An engine's 429 (it is full,
not sick) and the client's 4xx count neither way. That gateway then probes the
worker with a real one-token request (`/health` proves only that the HTTP server
runs: an engine failing every request still answers it); an answer closes the
circuit, a failure renews it with a doubled cooldown, up to `max_cooldown_s`. A
circuit that opens again soon after closing resumes from its last cooldown, so a
flapping worker backs off too. If nobody probes (that gateway died), the key simply
expires and the worker gets traffic again: half-open, one failure away from opening
again.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable

import structlog

from fleetgate.background import stop_tasks
from fleetgate.registry import Registry
from fleetgate.schema import WorkerView
from gateway.engines.upstream import Upstream
from gateway.errors import UpstreamError, detail

log = structlog.get_logger("gateway.circuit")


class Breakers:
    def __init__(
        self,
        registry: Registry,
        lookup: Callable[[str], WorkerView | None],
        on_change: Callable[[], None],
        upstream: Upstream,
        threshold: int = 3,
        cooldown_s: float = 5.0,
        max_cooldown_s: float = 60.0,
        probe_timeout_s: float = 10.0,
    ) -> None:
        self.registry = registry
        self.lookup = lookup
        self.on_change = on_change
        self.upstream = upstream  # the engines' one client: its probes go through it
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.probe_timeout_s = probe_timeout_s
        self.failures: dict[str, int] = {}
        # Worker -> (its last cooldown, when its circuit closed): where the next one starts.
        self._last: dict[str, tuple[float, float]] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}

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

    def _first_cooldown(self, worker_id: str) -> float:
        last = self._last.get(worker_id)
        if last is not None and time.monotonic() - last[1] < self.max_cooldown_s:
            return min(last[0] * 2, self.max_cooldown_s)  # it failed again soon after healing
        return self.cooldown_s

    async def _open_and_probe(self, worker_id: str, reason: str) -> None:
        cooldown = self._first_cooldown(worker_id)
        try:
            while True:
                why = f"{self.failures.get(worker_id, 0)} failures in a row, last: {reason}"[:300]
                try:
                    # Held through the probe too, so that a slow probe leaves no half-open gap.
                    await self.registry.open_circuit(worker_id, why, cooldown + self.probe_timeout_s)
                except Exception as exc:
                    log.warning("gateway.circuit_write_failed", worker=worker_id, error=repr(exc))
                self.on_change()
                log.warning("gateway.circuit_open", worker=worker_id, reason=why, cooldown_s=cooldown)
                await asyncio.sleep(cooldown * random.uniform(0.9, 1.0))
                worker = self.lookup(worker_id)
                if worker is None:
                    return  # it left the fleet
                failed = await self._probe(worker)
                if failed is None:
                    with contextlib.suppress(Exception):
                        await self.registry.close_circuit(worker_id)
                    self.failures.pop(worker_id, None)
                    self._last[worker_id] = (cooldown, time.monotonic())
                    self.on_change()
                    log.info("gateway.circuit_closed", worker=worker_id, cooldown_s=cooldown)
                    return
                reason = f"probe failed: {failed}"
                log.info("gateway.circuit_probe_failed", worker=worker_id, error=failed)
                cooldown = min(cooldown * 2, self.max_cooldown_s)
        finally:
            self._probes.pop(worker_id, None)

    async def _probe(self, worker: WorkerView) -> str | None:
        """A real one-token request to the engine: None if it answered (any status below 500:
        a 429 or 4xx is an answer), else what went wrong."""
        info = worker.info
        body: dict[str, object]
        if info.pooling:
            path, body = "/v1/embeddings", {"model": info.model, "input": "ping"}
        else:
            path, body = "/v1/completions", {"model": info.model, "prompt": "ping", "max_tokens": 1}
        try:
            status, _ = await self.upstream.post_json(info.url + path, body, self.probe_timeout_s)
        except UpstreamError as exc:
            return detail(exc)[:200]
        return None if status < 500 else f"engine answered {status}"

    async def close(self) -> None:
        await stop_tasks(*list(self._probes.values()))
