"""How a run's requests moved between workers: herding, and tenants sent away from home.

Both figures are read from what the client saw (each request's arrival time, its tag and
the worker that answered it), so they apply alike to a gateway's policies and to the
client-side strategies.

* Herding (issue 14): in a 1-second window of arrivals, nearly all of them (>= 90%) went
  to one worker. A router deciding on a stale load picture sends every request of that
  second the same way; an even spread over 2 workers does this by chance in under 1% of
  windows of 8 or more arrivals. Windows with fewer routed arrivals are not counted.
* Off-majority: the fraction of a tenant's requests that did not go to the worker that got
  most of that tenant's requests. 0 for perfect affinity, ~1 - 1/N for round-robin.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from fleetgate_tools.bench.strategies import tenant_of


class Routed(NamedTuple):
    at: float  # arrival, seconds after the run started
    worker: str | None  # None: no worker took it (a gateway's 429, a transport error)
    tag: str = ""


class Herding(NamedTuple):
    herded: int  # windows in which one worker got >= share of the arrivals
    windows: int  # windows with >= min_arrivals routed arrivals


def herding(
    requests: Iterable[Routed], *, window_s: float = 1.0, share: float = 0.9, min_arrivals: int = 8
) -> Herding:
    per_window: dict[int, Counter[str]] = defaultdict(Counter)
    for r in requests:
        if r.worker is not None:
            per_window[math.floor(r.at / window_s)][r.worker] += 1
    herded = windows = 0
    for counts in per_window.values():
        total = sum(counts.values())
        if total < min_arrivals:
            continue
        windows += 1
        if max(counts.values()) >= share * total:
            herded += 1
    return Herding(herded, windows)


def off_majority(requests: Sequence[Routed]) -> float | None:
    """The fraction of tenant-tagged, routed requests not on their tenant's majority
    worker; None when no request carries a tenant tag."""
    per_tenant: dict[int, Counter[str]] = defaultdict(Counter)
    for r in requests:
        tenant = tenant_of(r.tag)
        if tenant is not None and r.worker is not None:
            per_tenant[tenant][r.worker] += 1
    total = sum(sum(c.values()) for c in per_tenant.values())
    if not total:
        return None
    away = sum(sum(c.values()) - max(c.values()) for c in per_tenant.values())
    return away / total
