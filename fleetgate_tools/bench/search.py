"""The capacity rate: the highest arrival rate at which a strategy keeps TTFT p50 under a
target (issue 14: the tenant-affinity client, 0.2 s, on the KV-pressure fleet).

A coarse search multiplies the rate by `grow` while runs pass (divides it while they fail)
until one rate passes and the next fails; a fine search then bisects that bracket
`fine_steps` times. A run passes when its TTFT p50 is under the target, over all its
requests and over those that arrived in its later half, and at most 1% of its requests
failed, those still unfinished at the drain deadline included. In a short run the queue of
an overloaded fleet has not yet reached the median request; it shows in the later half and
in the requests left over at the end (so a step should last several request E2Es, and the
drain exceed one). Each step is one short run at one rate: noisy, so the answer is a rate
to benchmark at, not a hard limit.

`find_capacity` takes the run as a function, so the search itself is tested without a
fleet; the runner supplies one that plans and measures a run at the given rate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

MAX_ERROR_SHARE = 0.01


class Step(NamedTuple):
    rate: float
    ttft_p50: float | None
    ttft_p50_late: float | None  # over the requests that arrived in the later half
    ttft_p99: float | None
    errors: int
    requests: int
    passed: bool


def passes(run: Mapping[str, Any], target_p50: float) -> bool:
    p50 = run.get("ttft_p50")
    if p50 is not None:
        p50 = max(p50, run.get("ttft_p50_late") or 0.0)
    requests = int(run.get("requests") or 0)
    failed = int(run.get("errors") or 0)
    return p50 is not None and p50 < target_p50 and requests > 0 and failed <= MAX_ERROR_SHARE * requests


def describe(step: Step, phase: str) -> str:
    """One step's progress line."""
    p50 = "-" if step.ttft_p50 is None else f"{step.ttft_p50:.3f}"
    if step.ttft_p50_late is not None:
        p50 += f" (later half {step.ttft_p50_late:.3f})"
    p99 = "-" if step.ttft_p99 is None else f"{step.ttft_p99:.3f}"
    return (f"capacity {phase}: {step.rate:g} req/s -> TTFT p50 {p50} s, p99 {p99} s, "
            f"{step.errors}/{step.requests} errors: {'pass' if step.passed else 'over'}")  # fmt: skip


def find_capacity(
    measure: Callable[[float], Mapping[str, Any]],
    *,
    start: float,
    target_p50: float,
    grow: float = 2.0,
    fine_steps: int = 3,
    min_rate: float = 0.5,
    max_rate: float = 10_000.0,
    note: Callable[[str], None] = lambda _s: None,
) -> tuple[float | None, list[Step]]:
    """(the highest passing rate found, or None if even min_rate failed; every step)."""
    if start <= 0 or grow <= 1:
        raise ValueError("find_capacity needs start > 0 and grow > 1")
    steps: list[Step] = []

    def probe(rate: float, phase: str) -> bool:
        rate = round(rate, 1)
        run = measure(rate)
        ok = passes(run, target_p50)
        step = Step(rate, run.get("ttft_p50"), run.get("ttft_p50_late"), run.get("ttft_p99"),
                    int(run.get("errors") or 0), int(run.get("requests") or 0), ok)  # fmt: skip
        steps.append(step)
        note(describe(step, phase))
        return ok

    good, bad = _bracket(probe, start, grow, min_rate, max_rate)
    if good is None or bad is None:
        return (None if good is None else round(good, 1)), steps
    for _ in range(fine_steps):
        mid = (good + bad) / 2
        if round(mid, 1) in (round(good, 1), round(bad, 1)):
            break
        if probe(mid, "fine"):
            good = mid
        else:
            bad = mid
    return round(good, 1), steps


def _bracket(
    probe: Callable[[float, str], bool], start: float, grow: float, min_rate: float, max_rate: float
) -> tuple[float | None, float | None]:
    """The coarse phase: from `start`, up or down by `grow` until a passing rate and a failing
    one are neighbours (None for a side never found within min_rate..max_rate)."""
    good: float | None = None
    bad: float | None = None
    rate = start
    if probe(rate, "coarse"):
        good = rate
        while rate * grow <= max_rate:
            rate *= grow
            if not probe(rate, "coarse"):
                bad = rate
                break
            good = rate
    else:
        bad = rate
        while rate / grow >= min_rate:
            rate /= grow
            if probe(rate, "coarse"):
                good = rate
                break
            bad = rate
    return good, bad
