"""An agent cut off from Redis (a TCP proxy between it and Redis, cut then healed), with streams in
flight on its engine: they finish, its record expires meanwhile and it registers again within
seconds of the heal, and the registry holds each worker once, none that is gone. Real Redis,
gateway, agents and simulated engines."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx
import redis

from fleetgate.registry import Keys
from tests.conftest import Fleet
from tests.e2e.faults import Counts, HeldStream, TcpProxy, wait_for

MODEL = "fault-agent-model"
STREAMS = 6
# Long enough at time_scale=1 to outlast the record's TTL (3 s) and the cut.
TOKENS = 400


def test_agent_cut_off_from_redis_keeps_serving_and_registers_once_healed(
    fleet_factory: Callable[[], Fleet], tmp_path: Path,
) -> None:
    """Worker `a`'s agent reaches Redis only through a proxy. With streams in flight on `a`, the
    proxy is cut until `a`'s record has expired, then healed: every stream finishes whole, `a` is
    registered again within 5 s of the heal, and the registry lists `a` and `b` once each."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    target = urlparse(fleet.redis_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379)
    cut_side = Fleet(proxy.url(int(target.path.strip("/") or 0)), fleet.prefix, tmp_path)
    counts = Counts()
    try:
        agent = cut_side.worker("a", "--model", MODEL, "--option", "time_scale=1.0")
        fleet.worker("b", "--model", "fault-agent-other", "--option", "time_scale=0.1")
        fleet.wait_ready(url, "a", "b")
        assert proxy.connections > 0  # the precondition: a's agent talks to Redis through the proxy
        engine = str(fleet.workers(url)["a"]["url"])
        streams = [HeldStream(url, MODEL, TOKENS, f"agent cut {i}") for i in range(STREAMS)]
        for s in streams:
            assert s.first.wait(30), "no first event"
        assert {s.worker for s in streams} == {"a"}
        assert httpx.get(f"{engine}/sim/state").json()["running"] == STREAMS

        proxy.cut()
        cut_at = time.monotonic()
        # The record expires with its TTL (3 s): the agent could not heartbeat it.
        wait_for(lambda: "a" not in fleet.workers(url), timeout=15, interval=0.1)
        gone_s = time.monotonic() - cut_at
        # The precondition of the whole test: the streams were in flight across the cut.
        running = httpx.get(f"{engine}/sim/state").json()["running"]
        assert running == STREAMS and not any(s.outcome for s in streams), running

        proxy.heal()
        healed = time.monotonic()
        wait_for(lambda: fleet.workers(url).get("a", {}).get("state") == "ready", timeout=10, interval=0.1)
        back_s = time.monotonic() - healed
        for s in streams:
            s.join(counts)
        print(f"fault[agent-redis-cut]: record gone {gone_s:.2f} s after the cut, registered again "
              f"{back_s:.2f} s after the heal")
        counts.report("agent-redis-cut")
        assert counts.sent == STREAMS and counts.ok == STREAMS, counts.why
        assert back_s < 5.0

        # No duplicate, no ghost: the registry's index and the admin list name each worker once.
        with fleet.admin(url) as admin:
            listed = [w["id"] for w in admin.get("/admin/workers").json()["data"]]
        assert sorted(listed) == ["a", "b"], listed
        keys = Keys(fleet.prefix)
        direct = redis.Redis.from_url(fleet.redis_url)
        try:
            assert {m.decode() for m in direct.smembers(keys.workers)} == {"a", "b"}  # type: ignore[union-attr]
        finally:
            direct.close()
        # The same engine, registered again once: not a second worker beside it.
        assert fleet.workers(url)["a"]["url"] == engine
        out = agent.output()
        assert agent.alive() and out.count("agent.reregister") == 1
        # The outage in the agent's log: one line as it began and one as it ended, not one a beat.
        assert out.count('"agent.registry_unreachable"') == 1 and out.count('"agent.registry_reachable"') == 1, out
        with httpx.Client(base_url=url, timeout=30) as client:
            body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "after"}]}
            assert client.post("/v1/chat/completions", json=body).headers["x-fleetgate-worker"] == "a"
    finally:
        cut_side.close()
        proxy.close()
