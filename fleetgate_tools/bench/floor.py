"""A lower bound on adapter loads: what no routing policy can beat on a given trace.

Each worker holds its adapters in `slots` LoRA slots (vLLM: `--max-loras`, weights
enter a slot on first use and leave least recently used first), except `pinned`
workers, which load every adapter they serve once, at start (LMDeploy), and never
load again. For a trace of adapter requests (in arrival order):

* an adapter no pinned worker serves must be loaded at least once somewhere;
* for any set W of slot workers, the adapters that only workers in W can serve
  (call them A(W)) live in at most slots(W) slots at any time, however they are
  spread over W. Pooling those slots into one cache can only save loads, and on one
  cache Belady's rule (evict what is needed furthest in the future) loads the least.
  So the loads of A(W) are at least Belady's count over the requests for A(W).

The floor is the best of these bounds over every W (every subset while there are at
most `max_exact` slot workers, else the whole set). It ignores time and capacity
(requests that run together, workers too slow to carry an adapter's traffic), so a
real fleet stays above it; the gap says how much room routing has left.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Host:
    id: str
    adapters: frozenset[str]
    slots: int
    pinned: bool = False


def belady_loads(requests: Sequence[str], slots: int) -> int:
    """Loads of an optimal offline cache of `slots` entries serving `requests` in order."""
    if slots <= 0:
        return len(requests)
    # For each position, where the same name is requested next (len = never).
    next_use = [0] * len(requests)
    seen: dict[str, int] = {}
    for i in range(len(requests) - 1, -1, -1):
        next_use[i] = seen.get(requests[i], len(requests))
        seen[requests[i]] = i
    cache: dict[str, int] = {}  # name -> its next use
    loads = 0
    for i, name in enumerate(requests):
        if name not in cache:
            loads += 1
            if len(cache) >= slots:
                del cache[max(cache, key=cache.__getitem__)]
        cache[name] = next_use[i]
    return loads


def adapter_load_floor(requests: Iterable[str], hosts: Sequence[Host], max_exact: int = 12) -> int:
    """The fewest adapter loads any routing can do for `requests` (adapter names, in order)."""
    trace = list(requests)
    free = set().union(*(h.adapters for h in hosts if h.pinned)) if any(h.pinned for h in hosts) else set()
    slot_hosts = [h for h in hosts if not h.pinned and h.slots > 0]
    # Adapters that need a load somewhere: requested, and no pinned worker serves them.
    must_load = {a for a in trace if a not in free}
    servers = {a: frozenset(h.id for h in slot_hosts if a in h.adapters) for a in must_load}
    if len(slot_hosts) <= max_exact:
        groups: Iterable[Sequence[Host]] = (
            combo for n in range(1, len(slot_hosts) + 1) for combo in itertools.combinations(slot_hosts, n)
        )
    else:
        groups = [slot_hosts]
    best = len(must_load)
    for group in groups:
        ids = {h.id for h in group}
        only_here = {a for a in must_load if servers[a] and servers[a] <= ids}
        if not only_here:
            continue
        bound = belady_loads([a for a in trace if a in only_here], sum(h.slots for h in group))
        best = max(best, bound + len(must_load - only_here))
    return best
