"""Micro-benchmark of the routing decision: µs per request for fleets of 8 to 128 workers.

    .venv/bin/python scripts/bench_routing.py

Prints, per policy and fleet size, the time of `decide()` (filters + ranking) over a
snapshot of ready workers with varied load, with and without an affinity key: the median
of 7 rounds of 2,000 decisions, and in brackets the best round (the decision's own cost;
on a shared machine the median also carries whatever else ran meanwhile). Keyed requests
are as the gateway sees them: 50 keys, each already placed on a home, and one request in
50 a new key that must be placed.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fleetgate.hashing import stable_hash
from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.routing import POLICIES, FullAt, Live, RequestFacts, Routes, decide, make_policy
from gateway.routing.homes import Homes


def fleet(n: int) -> tuple[WorkerView, ...]:
    return tuple(
        WorkerView(
            info=WorkerInfo(id=f"w{i}", url=f"http://w{i}", engine="sim", model="base",
                            adapters=("fin",) if i % 3 == 0 else (), max_model_len=32768 if i % 2 else 4096,
                            capacity=256 if i % 2 else 64),
            state="ready",
            load=Load(running=i % 40, waiting=i % 5, kv_cache_usage=(i % 10) / 10),
            id_hash=stable_hash(f"w{i}"),
        )
        for i in range(n)
    )


def timings_us(workers: tuple[WorkerView, ...], policy_name: str, keyed: bool, rounds: int = 7) -> tuple[float, float]:
    policy = make_policy(policy_name)
    routes = Routes.build(workers)  # once per snapshot, in the background refresh
    inflight = Live({f"w{i}": i % 7 for i in range(len(workers))}, {f"w{i}": 1000 * (i % 7) for i in range(len(workers))},
                    Homes(placed={f"w{i}": 100.0 * (i % 5) for i in range(len(workers))}))
    full_at = FullAt()
    keys = [stable_hash(f"p{k}") for k in range(50)]
    homes = {key: f"w{k * 7 % len(workers)}" for k, key in enumerate(keys)}
    n = 2000
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for seq in range(n):
            key = keys[seq % 50] if keyed else None
            facts = RequestFacts("base", prompt_tokens=1200, max_tokens=256, seq=seq, pooling=False,
                                 affinity_key=key, affinity_kind="prefix" if keyed else None,
                                 prefix_tokens=1000, home=homes[key] if key is not None and seq % 50 else None)
            # As the gateway calls it: the best worker, with load shedding on.
            decide(routes, facts, inflight, policy, limit=1, full_at=full_at)
        samples.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(samples), min(samples)


def main() -> None:
    sizes = [8, 16, 64, 128]
    print(f"{'policy':<20}{'key':<6}" + "".join(f"{f'{n} workers':>22}" for n in sizes))
    for name in sorted(POLICIES):
        for keyed in (False, True):
            if keyed and name != "fleet":
                continue
            cells = [timings_us(fleet(n), name, keyed) for n in sizes]
            print(f"{name:<20}{'yes' if keyed else 'no':<6}"
                  + "".join(f"{f'{med:.1f} ({low:.1f}) µs':>22}" for med, low in cells))


if __name__ == "__main__":
    main()
