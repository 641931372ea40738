"""What every background loop needs: one log line when its step starts failing and one when
it works again (`Outage`), the loop itself (`repeat`), and a way to stop its tasks
(`stop_tasks`).

Every background loop (the gateways' Redis syncs, the agents' index writer, the autoscaler)
repeats a step forever; while Redis or a peer is away each step fails the same way, and a line
per step would bury the logs. An `Outage` says it once each way, and `repeat` is that loop,
written once:

    outage = Outage(log, "gateway.inflight_sync_failed", "gateway.inflight_sync_resumed")
    await repeat(step, outage, interval_s, errors=(RedisError, OSError), on_error=forget_peers)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


class Outage:
    """Whether a loop's step is failing, and the two log lines that mark the change."""

    __slots__ = ("failing", "fields", "log", "resumed_event", "started_event")

    def __init__(self, log: Any, started_event: str, resumed_event: str | None = None, **fields: Any) -> None:
        self.log = log
        self.started_event = started_event  # logged as a warning, with the error
        self.resumed_event = resumed_event  # logged as info (None: nothing is logged)
        self.fields = fields  # on both lines (which worker, say)
        self.failing = False

    def failed(self, exc: BaseException, **fields: Any) -> bool:
        """The step failed: the warning if it is the first of a run. True when it was."""
        if self.failing:
            return False
        self.failing = True
        self.log.warning(self.started_event, error=repr(exc), **self.fields, **fields)
        return True

    def ok(self, **fields: Any) -> bool:
        """The step worked: the recovery line if it had been failing. True when it had."""
        if not self.failing:
            return False
        self.failing = False
        if self.resumed_event is not None:
            self.log.info(self.resumed_event, **self.fields, **fields)
        return True


async def repeat(
    step: Callable[[], Awaitable[object]],
    outage: Outage,
    interval_s: float,
    *,
    errors: tuple[type[Exception], ...] = (Exception,),
    on_error: Callable[[], object] | None = None,
    wake: asyncio.Event | None = None,
) -> None:
    """Run `step` until cancelled, `interval_s` apart (sooner when `wake` is set). A step that
    raises one of `errors` is logged through `outage` (once per run of failures) and followed
    by `on_error` (drop what can no longer be trusted); anything else, and a cancel, ends the
    loop."""
    while True:
        try:
            await step()
            outage.ok()
        except errors as exc:
            outage.failed(exc)
            if on_error is not None:
                on_error()
        if wake is None:
            await asyncio.sleep(interval_s)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), interval_s)
            wake.clear()


async def stop_tasks(*tasks: asyncio.Task[Any] | None, again_after_s: float | None = None) -> None:
    """Cancel the tasks (None: none started), then wait for each to end. What a task raised on
    its way out is its own loop's to log: stopping goes on. `again_after_s`: cancel a task again
    each time it has not ended that long after the last cancel, for tasks that await a library
    known to lose a cancel (pyzmq's asyncio poll: workers/kv_events.py)."""
    live = [task for task in tasks if task is not None]
    for task in live:
        task.cancel()
    for task in live:
        # Not `await task`: a cancel of the caller (a timeout on its close, say) would be passed
        # on to the task and, once it ended, taken for the task's own and swallowed.
        await asyncio.wait({task}, timeout=again_after_s)
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=again_after_s)
        if not task.cancelled():
            task.exception()  # retrieved: asyncio would log it as never retrieved


__all__ = ["Outage", "repeat", "stop_tasks"]
