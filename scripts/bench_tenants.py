"""What tenants cost and how fast their config travels (docs/tenants.md's figures).

    .venv/bin/python scripts/bench_tenants.py [--redis-url redis://127.0.0.1:6379/13]

1. The Redis work a key with limits adds to a request: one admit script (before routing)
   and one settle script (at its end), all six limits on, timed in a loop.
2. A key created through gateway A's admin API: how long the PUT takes, and how long after
   it returned gateway B (another process) accepts the key (pub/sub; warm connections).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fleetgate.keys import Keys
from fleetgate.registry import connect
from gateway.tenants.quota import Quota
from gateway.tenants.tenants import KeyRecord, TeamRecord, Tenant
from gateway.tenants.usage import UsageMetrics
from tests.conftest import ADMIN_TOKEN, Fleet


async def scripts_cost(redis_url: str, calls: int) -> None:
    redis = connect(redis_url)
    quota = Quota(redis, Keys(f"fgbench-{uuid.uuid4().hex[:8]}"), UsageMetrics(CollectorRegistry()))
    team = TeamRecord(id="t", rpm=1e9, tpm=1e12, budget_tokens=10**15)
    tenant = Tenant(KeyRecord(id="k", secret_sha256="0" * 64, team="t", rpm=1e9, tpm=1e12,
                              budget_tokens=10**15), team)
    for rnd in range(3):
        admit, settle = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            ticket = await quota.admit(tenant, "m", 100)
            t1 = time.perf_counter()
            await ticket.settle(90, 20, 200)
            admit.append(t1 - t0)
            settle.append(time.perf_counter() - t1)
        print(f"scripts, round {rnd}: admit {statistics.median(admit) * 1e6:.0f} us, settle "
              f"{statistics.median(settle) * 1e6:.0f} us (medians of {calls})")
    await redis.aclose()


def propagation(redis_url: str, keys: int) -> None:
    fleet = Fleet(redis_url, f"fgbench-{uuid.uuid4().hex[:8]}", Path(tempfile.mkdtemp(prefix="bench-tenants-")))
    try:
        _, url_a = fleet.gateway("--set", "tenants_reload_s=30")  # measure pub/sub, not the re-read
        _, url_b = fleet.gateway("--set", "tenants_reload_s=30")
        puts, delays = [], []
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        with httpx.Client(base_url=url_a, headers=admin) as a, httpx.Client(base_url=url_b) as b:
            b.get("/health")
            for i in range(keys):
                t0 = time.perf_counter()
                secret = a.put(f"/admin/keys/bench-{i}", json={"rpm": 10}).json()["secret"]
                t1 = time.perf_counter()
                while b.get("/v1/models", headers={"authorization": f"Bearer {secret}"}).status_code != 200:
                    if time.perf_counter() - t1 > 10:
                        raise SystemExit(f"gateway B never accepted key bench-{i}")
                delays.append(time.perf_counter() - t1)
                puts.append(t1 - t0)
        print(f"PUT on A: median {statistics.median(puts) * 1000:.1f} ms, max {max(puts) * 1000:.1f} ms; "
              f"B accepts the key after the PUT returned: median {statistics.median(delays) * 1000:.1f} ms, "
              f"max {max(delays) * 1000:.1f} ms ({keys} keys)")
    finally:
        fleet.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--keys", type=int, default=30)
    args = parser.parse_args()
    asyncio.run(scripts_cost(args.redis_url, args.calls))
    propagation(args.redis_url, args.keys)


if __name__ == "__main__":
    main()
