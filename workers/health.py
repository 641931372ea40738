"""`python -m workers.health --id ID`: is this agent's worker routable, as the gateways see it?

The agent has no HTTP port of its own: what it knows about itself (starting, ready,
draining, its engine unhealthy) it publishes in its registry record, which the gateways
route by. This reads that record once and exits 0 when the worker is ready (its state is
`ready`, its heartbeat fresh, its signature one the gateways accept, its engine's probes
passing), else 1 with the reason on one line. Kubernetes runs it as the worker
container's startup and readiness probe (deploy/helm/fleetgate); the engine's own
health path is the liveness probe.

    python -m workers.health --id gpu-pool-0     # reads FLEETGATE_REDIS_URL, _REDIS_PREFIX, _REGISTRATION_SECRET
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

from fleetgate.registry import DEFAULT_HEARTBEAT_TTL_S, Registry, connect
from fleetgate.schema import WorkerView


def verdict(view: WorkerView | None, now: float, ttl_s: float = DEFAULT_HEARTBEAT_TTL_S) -> str:
    """"" when the worker is ready for traffic, else why not (pure: tests give it records)."""
    if view is None:
        return "no registry record (not registered yet, or its signature is not the gateways')"
    if view.state != "ready":
        return f"state {view.state}"
    if view.unhealthy:
        return "its engine fails its probes"
    if view.last_heartbeat and now - view.last_heartbeat > ttl_s:
        return f"last heartbeat {now - view.last_heartbeat:.1f} s ago"
    return ""


async def check(worker_id: str, redis_url: str, prefix: str, secret: str, timeout_s: float) -> str:
    redis = connect(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        view = await asyncio.wait_for(Registry(redis, prefix, secret=secret).read(worker_id), timeout_s)
    except Exception as exc:  # Redis away: not ready, and say why
        return f"registry unreachable: {exc!r}"
    finally:
        await redis.aclose()
    return verdict(view, time.time())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m workers.health", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--id", default=os.environ.get("FLEETGATE_WORKER_ID", ""),
                   help="the worker id, the agent's --id (default: $FLEETGATE_WORKER_ID)")
    p.add_argument("--redis-url", default=os.environ.get("FLEETGATE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--redis-prefix", default=os.environ.get("FLEETGATE_REDIS_PREFIX", "fleetgate"))
    p.add_argument("--timeout", type=float, default=2.0, help="seconds the registry may take")
    args = p.parse_args(argv)
    if not args.id:
        p.error("--id (or FLEETGATE_WORKER_ID) is required")
    secret = os.environ.get("FLEETGATE_REGISTRATION_SECRET", "")
    reason = asyncio.run(check(args.id, args.redis_url, args.redis_prefix, secret, args.timeout))
    print(f"worker {args.id}: {'ready' if not reason else 'not ready: ' + reason}")
    sys.exit(1 if reason else 0)


if __name__ == "__main__":
    main()
