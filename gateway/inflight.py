"""Requests in flight per worker: this gateway's, exact, plus the other replicas', shared through Redis.

The request path only touches the local dict (an increment and a decrement). A
background task publishes the local counts about ten times a second under a lease
and reads the other gateways' sum, so routing on every replica sees the whole
fleet's in-flight work without a Redis round trip per request, and a gateway that
crashes leaks nothing (its counts expire with its lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping

import structlog

from fleetgate.registry import Registry

log = structlog.get_logger("gateway.inflight")


class SharedInflight(Mapping[str, int]):
    def __init__(self, registry: Registry, gateway_id: str, interval_s: float = 0.1,
                 lease_s: float = 3.0) -> None:
        self.registry = registry
        self.gateway_id = gateway_id
        self.interval_s = interval_s
        self.lease_s = lease_s
        self.local: dict[str, int] = {}
        self.remote: dict[str, int] = {}
        self._remote_at = 0.0
        self._task: asyncio.Task[None] | None = None

    # -- the request path ----------------------------------------------------------

    def add(self, worker_id: str) -> None:
        self.local[worker_id] = self.local.get(worker_id, 0) + 1

    def done(self, worker_id: str) -> None:
        left = self.local.get(worker_id, 1) - 1
        if left > 0:
            self.local[worker_id] = left
        else:
            self.local.pop(worker_id, None)

    def get(self, worker_id: str, default: int = 0) -> int:  # type: ignore[override]
        return self.local.get(worker_id, 0) + self.remote.get(worker_id, 0) or default

    def __getitem__(self, worker_id: str) -> int:
        return self.get(worker_id)

    def __iter__(self) -> Iterator[str]:
        return iter(self.local.keys() | self.remote.keys())

    def __len__(self) -> int:
        return len(self.local.keys() | self.remote.keys())

    # -- background sync --------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="inflight-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.registry.forget_gateway(self.gateway_id)

    async def sync(self) -> None:
        await self.registry.publish_inflight(self.gateway_id, dict(self.local), self.lease_s)
        self.remote = await self.registry.read_inflight(exclude_gateway=self.gateway_id)
        self._remote_at = time.monotonic()

    async def _loop(self) -> None:
        failing = False
        while True:
            try:
                await self.sync()
                if failing:
                    log.info("gateway.inflight_sync_resumed")
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not failing:
                    log.warning("gateway.inflight_sync_failed", error=repr(exc))
                failing = True
                # Other replicas' counts expire with their lease; so do our copies of them.
                if time.monotonic() - self._remote_at > self.lease_s:
                    self.remote = {}
            await asyncio.sleep(self.interval_s)
