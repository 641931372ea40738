"""The admission queue: requests wait here, first come first served per model, while every
worker that could serve them is full by the gateway's own account.

Completions wake the queue (the in-flight account calls `wake`); only the head of each
model's line re-checks, so a completion admits the oldest request first and one decision
per completion is made, instead of every waiter polling. A slow re-check (`recheck_s`)
covers what no completion announces (a worker joining the fleet). The line is bounded
by the fleet's size (`limit()`), and a request waits at most until its deadline: either
way it is refused with 429 and the limit it hit, from a fixed set (`SHED_REASONS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import structlog

from gateway.errors import Overloaded

log = structlog.get_logger("gateway.admission")

# Why a request was refused with 429 by the gateway itself (a metric label: a fixed set).
SHED_REASONS = ("queue_full", "queue_timeout")
# Lines of requests held for one worker's KV room are named by this and the worker's id
# (no model name starts with a NUL).
_HOLD = "\0hold:"


class Shed(Overloaded):
    """Overloaded, with the limit that refused the request."""

    def __init__(self, message: str, *, reason: str, limit: str = "", retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)
        self.reason = reason
        # What the workers were full of when it gave up: "slots" or "kv".
        self.limit = limit


class _Waiter:
    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()


class Admission:
    def __init__(self, limit: Callable[[], int], recheck_s: float = 0.25) -> None:
        self.limit = limit
        self.recheck_s = recheck_s
        self._lines: dict[str, deque[_Waiter]] = {}

    @property
    def queued(self) -> int:
        """Requests waiting for room (those held for one worker's KV are not counted)."""
        return sum(len(line) for name, line in self._lines.items() if not name.startswith(_HOLD))

    @property
    def held(self) -> int:
        return sum(len(line) for name, line in self._lines.items() if name.startswith(_HOLD))

    def depths(self) -> dict[str, int]:
        """Requests waiting for room per requested model, as `queued` counts them (the scaling
        signal reads it)."""
        return {name: len(line) for name, line in self._lines.items() if line and not name.startswith(_HOLD)}

    def wake(self) -> None:
        """Room may have opened somewhere: the head of each line re-checks."""
        for line in self._lines.values():
            if line:
                line[0].event.set()

    async def hold(self, worker_id: str, room: Callable[[], bool], until: float) -> bool:
        """Return once `room()` is True, in arrival order per worker, or at `until` (never a
        429: a held request then goes on). True when it got room."""
        me = _Waiter()
        line = self._lines.setdefault(_HOLD + worker_id, deque())
        line.append(me)
        try:
            while True:
                if line[0] is me and room():
                    return True
                left = until - time.monotonic()
                if left <= 0:
                    return False
                await self._nap(me, left)
        finally:
            self._release(line, _HOLD + worker_id, me)

    async def _nap(self, me: _Waiter, left: float) -> None:
        """Until a completion wakes `me`, the slow re-check, or `left` seconds pass."""
        me.event.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left, self.recheck_s)):
                await me.event.wait()

    def _release(self, line: deque[_Waiter], name: str, me: _Waiter) -> None:
        line.remove(me)
        if line:
            line[0].event.set()  # the next in line checks at once
        else:
            self._lines.pop(name, None)

    async def wait(self, model: str, full: Callable[[], str | None], deadline: float, retry_after: float) -> None:
        """Return once `full()` says None (there is room), in arrival order for `model`.

        `full()` names the limit every eligible worker is at ("slots", "kv") while there is none.
        """
        if self.queued >= self.limit():
            log.info("gateway.shed", reason="queue_full", model=model, queued=self.queued)
            raise Shed("Every worker is at capacity and the gateway's queue is full; try again shortly.",
                       reason="queue_full", retry_after=retry_after)
        me = _Waiter()
        line = self._lines.setdefault(model, deque())
        line.append(me)
        why: str | None = "slots"
        try:
            while True:
                if line[0] is me:
                    why = full()
                    if why is None:
                        return
                left = deadline - time.monotonic()
                if left <= 0:
                    log.info("gateway.shed", reason="queue_timeout", limit=why, model=model, queued=self.queued)
                    raise Shed(f"Every worker serving `{model}` is at capacity ({why}); try again shortly.",
                               reason="queue_timeout", limit=why or "", retry_after=retry_after)
                await self._nap(me, left)
        finally:
            self._release(line, model, me)


__all__ = ["SHED_REASONS", "Admission", "Shed"]
