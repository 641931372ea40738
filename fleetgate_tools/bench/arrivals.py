"""When a workload's requests arrive: seeded arrival processes, independent of the contents.

* bursty: a Markov-modulated Poisson process: bursts at `burst` times the mean rate
  alternate with calm spells, so the mean stays at the target rate;
* poisson: a plain Poisson process, the tenant workloads' default.

A workload's params choose with `arrivals: poisson|bursty`. Each process draws from its own
RNG, seeded apart from the contents' (fleetgate_tools/bench/workloads.py), so the same
requests can be sent at any rate.
"""

from __future__ import annotations

import random
from typing import Any

# Workloads whose arrivals are plain Poisson unless their params say `arrivals: bursty`.
POISSON_WORKLOADS = frozenset({"pressure", "skew", "pressure_long", "lora"})


def bursty_arrivals(
    rate: float, duration: float, seed: int, *, burst: float = 2.0, mean_phase_s: float = 2.0
) -> list[float]:
    """Arrival times in [0, duration) at mean `rate`/s: bursts at burst x rate for about a
    third of the time, calm spells at the rate that keeps the mean (Poisson within each)."""
    if rate <= 0 or duration <= 0:
        return []
    rng = random.Random(f"arrivals:{seed}")
    burst_frac = 1 / 3
    calm_rate = max(0.0, rate * (1 - burst * burst_frac) / (1 - burst_frac))
    t, out = 0.0, []
    bursting = rng.random() < burst_frac
    while t < duration:
        mean = mean_phase_s * (burst_frac if bursting else 1 - burst_frac) * 2
        end = min(duration, t + rng.expovariate(1 / mean))
        r = rate * burst if bursting else calm_rate
        if r > 0:
            while True:
                t += rng.expovariate(r)
                if t >= end:
                    break
                out.append(t)
        t = end
        bursting = not bursting
    return out


def poisson_arrivals(rate: float, duration: float, seed: int) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process at `rate`/s."""
    if rate <= 0 or duration <= 0:
        return []
    rng = random.Random(f"poisson:{seed}")
    t, out = rng.expovariate(rate), []
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def arrivals(
    workload: str, rate: float, duration: float, seed: int, params: dict[str, Any] | None = None
) -> list[float]:
    """The workload's arrival process: `arrivals` in its params, else its default."""
    default = "poisson" if workload in POISSON_WORKLOADS else "bursty"
    kind = str((params or {}).get("arrivals", default))
    if kind == "poisson":
        return poisson_arrivals(rate, duration, seed)
    if kind == "bursty":
        return bursty_arrivals(rate, duration, seed)
    raise ValueError(f"unknown arrival process {kind!r}; known: poisson, bursty")
