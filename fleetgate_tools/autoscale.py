"""`fleetgate autoscale`'s decisions: how many workers a model should gain or lose now. Pure.

The loop (fleetgate_tools/autoscale_loop.py) reads the gateway's scaling signal
(`GET /admin/scaling`, gateway/api/scaling.py) once a tick, turns each model's entry into
an `Observed`, and acts on what `decide` says; `decide` keeps no state of its own
(the `History` it returns is the next tick's input).

    up     when the model is hot: saturation >= up_saturation, or a queue of at least
           up_queue, or KV use >= up_kv; not while a worker it added is still starting
           (its capacity is on the way), not within up_cooldown_s of the last addition,
           never past max_workers. It adds what brings saturation to up_saturation,
           at most `step` at once.
    down   when the model has been cold (saturation <= down_saturation, no queue) for
           down_after_s, not within down_cooldown_s of the last change, one at a time
           (none while another drains), never below min_workers, and only if the
           workers left would stay below the up thresholds (hysteresis: no flapping).
    hold   otherwise, with the reason.

Below min_workers it adds at once, whatever the load (a worker died).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

Action = Literal["up", "down", "hold"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    min_workers: int = 1
    max_workers: int = 4
    up_saturation: float = 0.8
    down_saturation: float = 0.3
    up_queue: int = 1
    up_kv: float = 0.9
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 60.0
    down_after_s: float = 60.0
    step: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 0 <= min_workers <= max_workers, got {self.min_workers}, {self.max_workers}")
        if not 0 <= self.down_saturation < self.up_saturation:
            raise ValueError("down_saturation must be below up_saturation (the hysteresis band)")
        if self.step < 1 or self.up_queue < 1:
            raise ValueError("step and up_queue must be at least 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class Observed:
    """One model, now: the signal plus what the loop knows itself."""

    ready: int
    # Starting: registered as starting, or launched and not registered yet.
    starting: int = 0
    draining: int = 0
    capacity: int = 0  # sequence slots of the ready workers
    outstanding: int = 0  # in flight on the ready workers
    queue_depth: int = 0
    kv_use_ratio: float | None = None
    # Ready workers the loop may retire (it started them): down needs one.
    retirable: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class History:
    last_up: float = -math.inf
    last_down: float = -math.inf
    # Since when the model has been cold; None while it is not.
    cold_since: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    action: Action
    count: int
    reason: str
    history: History
    saturation: float | None = None


def saturation(o: Observed) -> float | None:
    return o.outstanding / o.capacity if o.capacity else None


def _hot(p: Policy, o: Observed, sat: float | None) -> str:
    """Why the model is hot ('' when it is not)."""
    if sat is not None and sat >= p.up_saturation:
        return f"saturation {sat:.2f} >= {p.up_saturation:g}"
    if o.queue_depth >= p.up_queue:
        return f"queue {o.queue_depth} >= {p.up_queue}"
    if o.kv_use_ratio is not None and o.kv_use_ratio >= p.up_kv:
        return f"kv use {o.kv_use_ratio:.2f} >= {p.up_kv:g}"
    return ""


def _wanted(p: Policy, o: Observed, active: int) -> int:
    """Workers to add so that saturation comes down to up_saturation (1 .. step)."""
    if not o.ready or not o.capacity:
        return 1
    per_worker = o.capacity / o.ready
    need = math.ceil((o.outstanding + o.queue_depth) / (per_worker * p.up_saturation))
    return max(1, min(p.step, need - active, p.max_workers - active))


def _fits_one_fewer(p: Policy, o: Observed, sat: float | None) -> bool:
    """Whether the model stays below the up thresholds with one ready worker fewer."""
    if o.ready <= 1:
        return o.outstanding == 0 and o.queue_depth == 0
    left = (o.ready - 1) / o.ready
    if sat is not None and sat / left >= p.up_saturation:
        return False
    return o.kv_use_ratio is None or o.kv_use_ratio / left < p.up_kv


def decide(p: Policy, o: Observed, h: History, now: float) -> Decision:
    sat = saturation(o)
    active = o.ready + o.starting
    if active < p.min_workers:
        return Decision(action="up", count=p.min_workers - active, reason=f"{active} < min {p.min_workers}",
                        history=replace(h, last_up=now, cold_since=None), saturation=sat)
    hot = _hot(p, o, sat)
    if hot:
        return _when_hot(p, o, replace(h, cold_since=None), now, sat, active, hot)
    cold = (sat is None or sat <= p.down_saturation) and o.queue_depth == 0
    if not cold:
        return _hold("steady", replace(h, cold_since=None), sat)
    return _when_cold(p, o, h if h.cold_since is not None else replace(h, cold_since=now), now, sat, active)


def _hold(reason: str, h: History, sat: float | None) -> Decision:
    return Decision(action="hold", count=0, reason=reason, history=h, saturation=sat)


def _when_hot(p: Policy, o: Observed, h: History, now: float, sat: float | None, active: int, hot: str) -> Decision:
    """Up, unless at max, still starting one, or within the up cool-down."""
    if active >= p.max_workers:
        return _hold(f"{hot}, at max {p.max_workers}", h, sat)
    if o.starting:
        return _hold(f"{hot}, {o.starting} starting", h, sat)
    if now - h.last_up < p.up_cooldown_s:
        return _hold(f"{hot}, up cool-down {p.up_cooldown_s - (now - h.last_up):.0f}s", h, sat)
    return Decision(action="up", count=_wanted(p, o, active), reason=hot,
                    history=replace(h, last_up=now), saturation=sat)


def _when_cold(p: Policy, o: Observed, h: History, now: float, sat: float | None, active: int) -> Decision:
    """Down by one once cold long enough, unless something in `_why_not_down` holds it."""
    cold_s = now - h.cold_since if h.cold_since is not None else 0.0
    why_not = _why_not_down(p, o, h, now, sat, active, cold_s)
    if why_not:
        return _hold(why_not, h, sat)
    return Decision(action="down", count=1, reason=f"saturation {sat or 0:.2f} <= {p.down_saturation:g}"
                    f" for {cold_s:.0f}s", history=replace(h, last_down=now, cold_since=None),
                    saturation=sat)


def _why_not_down(p: Policy, o: Observed, h: History, now: float, sat: float | None, active: int,
                  cold_s: float) -> str:
    """Why a cold model keeps its workers for now ('' when it may lose one)."""
    if active <= p.min_workers:
        return f"cold, at min {p.min_workers}"
    if o.starting or o.draining:
        return f"cold, {o.starting} starting, {o.draining} draining"
    if cold_s < p.down_after_s:
        return f"cold for {cold_s:.0f}s of {p.down_after_s:g}s"
    since = now - max(h.last_up, h.last_down)
    if since < p.down_cooldown_s:
        return f"cold, down cool-down {p.down_cooldown_s - since:.0f}s"
    if not o.retirable:
        return "cold, no worker this autoscaler may retire"
    if not _fits_one_fewer(p, o, sat):
        return "cold, but one worker fewer would be hot"
    return ""


__all__ = ["Action", "Decision", "History", "Observed", "Policy", "decide", "saturation"]
