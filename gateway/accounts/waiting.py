"""Requests waiting on an engine's first byte, and what happens to them when it hangs.

An engine that hangs (SIGSTOP, a wedged process) still holds its open connections: the
requests already sent there would wait out their whole timeout. When the agent publishes
the worker unhealthy (its probes failed: fleetgate/schema.py `Load.unhealthy`) or the
worker leaves the registry, every request still waiting on it with no byte sent is
interrupted at once and retried elsewhere like any failure before the first byte; so is a
stream whose engine sent its response headers but no event yet (gateway/request/relay.py waits for
its first event inside `waiting`).

The request path pays a dict insert and delete per attempt: the waiting task itself is
cancelled (and uncancelled, turned into `WorkerWentAway`), no extra task is created.
A background check runs only when the fleet snapshot changes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import structlog

from fleetgate.background import stop_tasks
from fleetgate.schema import WorkerView
from gateway.errors import UpstreamError
from gateway.fleet import FleetSnapshot

log = structlog.get_logger("gateway.waiting")

# An engine report at most this many of its agent's heartbeat intervals old says the engine is
# alive now (WorkerInfo.heartbeat_s; an agent that does not say heartbeats every second).
REPORT_FRESH_BEATS = 5.0
DEFAULT_HEARTBEAT_S = 1.0


def report_fresh_s(view: WorkerView) -> float:
    """How old a report of `view`'s engine may be and still say it is alive now."""
    return REPORT_FRESH_BEATS * (view.info.heartbeat_s or DEFAULT_HEARTBEAT_S)


def engine_queued(view: WorkerView | None) -> bool:
    """Whether the worker's engine says, in a fresh healthy report, that it holds requests
    waiting (its queue, or adapters waiting for a LoRA slot): an answer not come yet is then a
    wait in that queue, not a hung engine."""
    if view is None or view.unhealthy:
        return False
    load = view.load
    return (load.waiting > 0 or load.deferred > 0) and time.time() - load.ts <= report_fresh_s(view)


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

    def waiting(self, worker_id: str, task: asyncio.Task[Any] | None = None) -> _Waiting:
        """Around an await for `worker_id`'s first byte: raises WorkerWentAway when the worker
        turns unhealthy or leaves meanwhile. `task`: the current task, where the caller has it
        (asyncio.current_task() is interpreted Python before 3.12)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="first-byte-waits")
        return _Waiting(self, worker_id, task)

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
        await stop_tasks(self._task)


class _Waiting:
    """`FirstByteWaits.waiting`'s context: a plain class, as it is entered once or twice per
    attempt (a generator-based context manager costs several times as much)."""

    __slots__ = ("_task", "_tasks", "_waits", "_worker_id")

    def __init__(self, waits: FirstByteWaits, worker_id: str, task: asyncio.Task[Any] | None) -> None:
        self._waits = waits
        self._worker_id = worker_id
        self._task: asyncio.Task[object] | None = task
        self._tasks: set[asyncio.Task[object]] | None = None

    def __enter__(self) -> asyncio.Task[object] | None:
        """The current task."""
        task = self._task
        if task is None:
            task = self._task = asyncio.current_task()
        if task is None:  # pragma: no cover - always inside a task in the gateway
            return None
        tasks = self._tasks = self._waits._waiting.get(self._worker_id)
        if tasks is None:
            tasks = self._tasks = self._waits._waiting[self._worker_id] = set()
        tasks.add(task)
        return task

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        task, tasks = self._task, self._tasks
        if task is None or tasks is None:  # pragma: no cover
            return
        waits, worker_id = self._waits, self._worker_id
        interrupted = task in waits._interrupted
        tasks.discard(task)
        if not tasks and waits._waiting.get(worker_id) is tasks:
            del waits._waiting[worker_id]
        waits._interrupted.discard(task)
        if interrupted and kind is not None and issubclass(kind, asyncio.CancelledError):
            task.uncancel()
            raise WorkerWentAway(f"worker {worker_id} turned unhealthy or left while the request "
                                 "waited for its first byte") from None


__all__ = ["FirstByteWaits", "WorkerWentAway", "engine_queued", "report_fresh_s"]
