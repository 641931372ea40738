"""Requests waiting on an engine's first byte, and what happens to them when it hangs.

An engine that hangs (SIGSTOP, a wedged process) still holds its open connections: the
requests already sent there would wait out their whole timeout. When the agent publishes
the worker unhealthy (its probes failed: fleetgate/schema.py `Load.unhealthy`) or the
worker leaves the registry, every request still waiting on it with no byte sent is
interrupted at once and retried elsewhere like any failure before the first byte; so is a
stream whose engine sent its response headers but no event yet (gateway/relay.py waits for
its first event inside `waiting`).

The request path pays a dict insert and delete per attempt: the waiting task itself is
cancelled (and uncancelled, turned into `WorkerWentAway`), no extra task is created.
A background check runs only when the fleet snapshot changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import structlog

from gateway.errors import UpstreamError
from gateway.fleet import FleetSnapshot

log = structlog.get_logger("gateway.waiting")


class WorkerWentAway(UpstreamError):
    """The worker turned unhealthy or left while the request waited for its first byte."""


class FirstByteWaits:
    def __init__(self, snapshot: Callable[[], FleetSnapshot], interval_s: float = 0.05) -> None:
        self.snapshot = snapshot
        self.interval_s = interval_s
        # worker id -> tasks waiting there for a first byte
        self._waiting: dict[str, set[asyncio.Task[object]]] = {}
        self._interrupted: set[asyncio.Task[object]] = set()
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def waiting(self, worker_id: str) -> Iterator[None]:
        """Around an await for `worker_id`'s first byte: raises WorkerWentAway when the worker
        turns unhealthy or leaves meanwhile."""
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always inside a task in the gateway
            yield
            return
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="first-byte-waits")
        tasks = self._waiting.setdefault(worker_id, set())
        tasks.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if task not in self._interrupted:
                raise  # the client left, or the gateway is stopping
            self._interrupted.discard(task)
            task.uncancel()
            raise WorkerWentAway(f"worker {worker_id} turned unhealthy or left while the request "
                                 "waited for its first byte") from None
        finally:
            tasks.discard(task)
            if not tasks and self._waiting.get(worker_id) is tasks:
                del self._waiting[worker_id]
            self._interrupted.discard(task)

    def check(self, snapshot: FleetSnapshot) -> None:
        for worker_id, tasks in list(self._waiting.items()):
            view = snapshot.by_id.get(worker_id)
            if view is not None and not view.unhealthy:
                continue
            fresh = tasks - self._interrupted
            if not fresh:
                continue
            for task in fresh:
                self._interrupted.add(task)
                task.cancel()
            log.warning("gateway.waiting_interrupted", worker=worker_id, requests=len(fresh),
                        why=view.load.unhealthy if view is not None else "left the registry")

    async def _loop(self) -> None:
        seen: FleetSnapshot | None = None
        while True:
            await asyncio.sleep(self.interval_s)
            snapshot = self.snapshot()
            if snapshot is not seen and self._waiting:
                seen = snapshot
                self.check(snapshot)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


__all__ = ["FirstByteWaits", "WorkerWentAway"]
