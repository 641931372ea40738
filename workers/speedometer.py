"""A worker's speed while it serves, measured from the engine's own counters.

The start-up figure (a profile, `--speed`, or one timed probe batch: `workers/speed.py`)
is what the card was doing at that moment; this keeps measuring. Each scrape the agent
hands over the engine's work counters (`EngineWork`, cumulative):

    a window of scrapes, until it holds MIN_TOKENS new tokens and a latency observation
    -> one sample: the reference card's time for the window's average step over the
       engine's own (seconds per step from its inter-token latency)
    -> the median of the last MEDIAN_OF samples (one odd window moves nothing)
    -> an exponential average, its clock the time the engine was busy (TAU_S)

Capability, not load: a sample compares a step's duration with the reference card's for a
step of the same size (sequences decoding, prompt tokens computed beside them:
`speed.reference_step`), so a lightly loaded engine is not a slow one; tokens per second
would call it slow. The step's size is counted where the engine counts its steps (vLLM),
else taken by Little's law (tokens per busy second x seconds per step: LMDeploy). An idle
engine teaches nothing: the estimate stays, and idle time neither ages it nor dilutes the
next window. Counters that go back (the engine restarted) start a new window.

Pure: no I/O, no clock; callers pass `now`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from workers.engines.base import EngineWork
from workers.speed import clamp_speed, reference_step

# The average's time constant, in seconds of engine work: a halved card is seen at ~0.55
# of its old figure about 4 s after its first slow window, and single samples a few
# percent apart move it by about half their difference.
TAU_S = 1.5
# Fewer tokens than this in a window say too little: the window grows until it has them.
MIN_TOKENS = 16
MEDIAN_OF = 3

ENGINE = "engine"


def sample_speed(work: EngineWork, busy_s: float) -> float | None:
    """The speed one window of work shows (`work`: the counters' differences over it,
    `busy_s`: the seconds it generated), or None when it says nothing."""
    if work.latency_count <= 0 or work.latency_sum <= 0 or work.generated <= 0:
        return None
    step_s = work.latency_sum / work.latency_count
    if work.steps > 0:
        decoding, prefill = work.generated / work.steps, work.prefilled / work.steps
    elif busy_s > 0:
        decoding, prefill = work.generated / busy_s * step_s, work.prefilled / busy_s * step_s
    else:
        return None
    return clamp_speed(reference_step(decoding, prefill) / step_s)


def _minus(a: EngineWork, b: EngineWork) -> EngineWork:
    return EngineWork(
        generated=a.generated - b.generated, prefilled=a.prefilled - b.prefilled, steps=a.steps - b.steps,
        latency_sum=a.latency_sum - b.latency_sum, latency_count=a.latency_count - b.latency_count,
    )


def _went_back(a: EngineWork, b: EngineWork) -> bool:
    return a.generated < b.generated or a.latency_count < b.latency_count or a.steps < b.steps


class Speedometer:
    """The running estimate, seeded by the start-up figure (`seed`, from `seed_source`).

    `pinned`: an operator's `--speed`, kept as declared whatever the engine shows."""

    def __init__(self, seed: float, seed_source: str, *, pinned: bool = False, tau_s: float = TAU_S) -> None:
        self.speed = seed if seed > 0 else 1.0
        self.source = seed_source
        self.pinned = pinned
        self.tau_s = tau_s
        self.samples = 0
        self._last: EngineWork | None = None
        self._last_at = 0.0
        self._window = EngineWork()  # the counters where the current window began
        self._busy_s = 0.0
        self._recent: deque[float] = deque(maxlen=MEDIAN_OF)

    def observe(self, work: EngineWork, now: float) -> float:
        """Take one scrape's counters; the estimate after it."""
        if self.pinned:
            return self.speed
        last, last_at = self._last, self._last_at
        self._last, self._last_at = work, now
        if last is None or _went_back(work, last):
            self._window, self._busy_s = work, 0.0
            return self.speed
        if work.generated > last.generated:
            self._busy_s += max(0.0, now - last_at)
        window = _minus(work, self._window)
        if window.generated < MIN_TOKENS or window.latency_count <= 0:
            return self.speed
        busy_s = self._busy_s
        self._window, self._busy_s = work, 0.0
        sample = sample_speed(window, busy_s)
        if sample is None:
            return self.speed
        self._recent.append(sample)
        value = statistics.median(self._recent)
        alpha = 1.0 - math.exp(-busy_s / self.tau_s) if self.tau_s > 0 else 1.0
        self.speed = round(self.speed + alpha * (value - self.speed), 4)
        self.source = ENGINE
        self.samples += 1
        return self.speed
