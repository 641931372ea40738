"""The admission queue: requests wait here while every worker that could serve them is full
by the gateway's own account, and leave in a weighted fair order per model.

Each requested model has a `FairQueue` (gateway/accounts/fairqueue.py): across priority classes by
weight, within a class across keys by tokens; with one class and one key it is first come,
first served. Completions wake the queue (the in-flight account calls `wake`); then only
the first waiter of each class re-checks for room (`full()`, which counts a worker full at
its class's share), and the first in fair order with room goes: one admission at a time
per model, the next checked once the admitted request has taken its place (so two never
count the same room). A slow re-check (`recheck_s`) covers what no completion announces
(a worker joining the fleet). The queue is bounded by the fleet's size (`limit()`): when
it is full an arrival takes the place of the newest waiter of a lighter class, if any, and
is refused otherwise; a request waits at most until its deadline. Either way the refusal
is a 429 with the limit it hit, from a fixed set (`SHED_REASONS`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping

import structlog

from gateway.accounts.fairqueue import FairQueue, Ticket
from gateway.errors import Overloaded

log = structlog.get_logger("gateway.admission")

# Why a request was refused with 429 by the gateway itself (a metric label: a fixed set).
SHED_REASONS = ("queue_full", "queue_timeout")
DEFAULT_CLASS = "default"


class Shed(Overloaded):
    """Overloaded, with the limit that refused the request."""

    def __init__(self, message: str, *, reason: str, limit: str = "", retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)
        self.reason = reason
        # What the workers were full of when it gave up: "slots" or "kv".
        self.limit = limit


class _Waiter:
    __slots__ = ("admitted", "displaced", "event", "full", "why")

    def __init__(self, full: Callable[[], str | None] | None = None) -> None:
        self.event = asyncio.Event()
        self.full = full
        self.why: str | None = "slots"
        self.admitted = False
        self.displaced = False


class Admission:
    def __init__(self, limit: Callable[[], int], recheck_s: float = 0.25,
                 weights: Mapping[str, float] | None = None) -> None:
        self.limit = limit
        self.recheck_s = recheck_s
        self.weights = dict(weights or {DEFAULT_CLASS: 1.0})
        self._queues: dict[str, FairQueue[_Waiter]] = {}
        # Per model: the waiter admitted whose request has not taken its room yet.
        self._admitting: dict[str, _Waiter] = {}
        self._holds: dict[str, deque[_Waiter]] = {}
        self._seq = itertools.count().__next__
        self._woken = False
        # (class, reason) -> requests refused with 429 since start (PriorityCollector reads it).
        self.sheds: dict[tuple[str, str], int] = {}

    @property
    def queued(self) -> int:
        """Requests waiting for room (those held for one worker's KV are not counted)."""
        return sum(len(q) for q in self._queues.values())

    @property
    def held(self) -> int:
        return sum(len(line) for line in self._holds.values())

    def depths(self) -> dict[str, int]:
        """Requests waiting for room per requested model, as `queued` counts them (the scaling
        signal reads it)."""
        return {model: len(q) for model, q in self._queues.items() if len(q)}

    def class_depths(self) -> dict[str, int]:
        out = dict.fromkeys(self.weights, 0)
        for q in self._queues.values():
            for name, n in q.depths().items():
                out[name] += n
        return out

    def wake(self) -> None:
        """Room may have opened somewhere: held requests re-check, and each model's queue
        admits the next in fair order that has room (soon: not inside the caller's step)."""
        for line in self._holds.values():
            if line:
                line[0].event.set()
        if self._queues and not self._woken:
            self._woken = True
            asyncio.get_running_loop().call_soon(self._admit_all)

    def _admit_all(self) -> None:
        self._woken = False
        for model in list(self._queues):
            self._admit(model)

    def _admit(self, model: str) -> None:
        """Let the first class head in fair order that has room go (one per model at a time)."""
        q = self._queues.get(model)
        if q is None or model in self._admitting:
            return
        for ticket in q.heads():
            waiter = ticket.item
            waiter.why = waiter.full() if waiter.full is not None else None
            if waiter.why is None:
                q.pop(ticket)
                waiter.admitted = True
                self._admitting[model] = waiter
                waiter.event.set()
                return

    async def hold(self, worker_id: str, room: Callable[[], bool], until: float) -> bool:
        """Return once `room()` is True, in arrival order per worker, or at `until` (never a
        429: a held request then goes on). True when it got room."""
        me = _Waiter()
        line = self._holds.setdefault(worker_id, deque())
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
            line.remove(me)
            if line:
                line[0].event.set()  # the next in line checks at once
            else:
                self._holds.pop(worker_id, None)

    async def _nap(self, me: _Waiter, left: float) -> bool:
        """Until something wakes `me`, the slow re-check, or `left` seconds pass; True when woken."""
        me.event.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(left, self.recheck_s)):
                await me.event.wait()
                return True
        return False

    def _shed(self, priority: str, reason: str, model: str, message: str, retry_after: float,
              why: str | None = None) -> Shed:
        self.sheds[(priority, reason)] = self.sheds.get((priority, reason), 0) + 1
        log.info("gateway.shed", reason=reason, limit=why, model=model, priority=priority, queued=self.queued)
        return Shed(message, reason=reason, limit=why or "", retry_after=retry_after)

    def _displace(self, weight: float) -> bool:
        """Refuse the newest waiter of the lightest class lighter than `weight`; False: none."""
        found: list[tuple[float, int, FairQueue[_Waiter], Ticket[_Waiter]]] = []
        for q in self._queues.values():
            if (t := q.victim(weight)) is not None:
                found.append((self.weights[t.cls], -t.seq, q, t))
        if not found:
            return False
        _, _, q, victim = min(found, key=lambda f: (f[0], f[1]))
        q.remove(victim)
        victim.item.displaced = True
        victim.item.event.set()
        return True

    async def wait(self, model: str, full: Callable[[], str | None], deadline: float, retry_after: float,
                   priority: str = DEFAULT_CLASS, key: str = "", tokens: float = 1.0) -> None:
        """Return once `full()` says None (there is room) and it is this request's turn: by
        class weight, and within `priority` by the tokens each key has had admitted.

        `full()` names the limit every eligible worker is at ("slots", "kv") while there is none.
        """
        if self.queued >= self.limit() and not self._displace(self.weights[priority]):
            raise self._shed(priority, "queue_full", model, "Every worker is at capacity and the gateway's "
                             "queue is full; try again shortly.", retry_after)
        me = _Waiter(full)
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = FairQueue(self.weights, self._seq)
        ticket = q.push(me, priority, key, tokens)
        self._admit(model)
        try:
            while not me.admitted:
                if me.displaced:
                    raise self._shed(priority, "queue_full", model, "The gateway's queue is full and a request "
                                     "of a higher priority took this one's place; try again shortly.",
                                     retry_after, me.why)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._shed(priority, "queue_timeout", model, f"Every worker serving `{model}` is at "
                                     f"capacity ({me.why}); try again shortly.", retry_after, me.why)
                if not await self._nap(me, left) and q.first() is ticket:
                    self._admit(model)  # the slow re-check, once per queue
        finally:
            q.remove(ticket)
            if self._admitting.get(model) is me:
                del self._admitting[model]
            if not len(q) and self._queues.get(model) is q:
                del self._queues[model]
            if model in self._queues:  # the next goes once this one has taken its room (or left)
                asyncio.get_running_loop().call_soon(self._admit, model)


__all__ = ["SHED_REASONS", "Admission", "Shed"]
