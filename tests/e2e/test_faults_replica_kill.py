"""One of two gateway replicas SIGKILLed with 50 streams in flight: the other replica's view of
those workers' load (the in-flight count it reads from the dead one's lease, and the engines'
reports) returns to the engines' own within the lease, and nothing stays counted as busy there.
Real Redis, gateways, agents and simulated engines."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import httpx
import redis

from fleetgate.keys import DEFAULT_INFLIGHT_LEASE_S
from fleetgate.registry import Keys
from tests.conftest import Fleet
from tests.e2e.faults import Counts, HeldStream, wait_for

MODEL = "fault-replica-model"
STREAMS = 50
TOKENS = 400  # at time_scale=1: streams that outlast the kill and the lease by far


def _engines_running(engines: dict[str, str]) -> int:
    return sum(int(httpx.get(f"{url}/sim/state", timeout=5).json()["running"]) for url in engines.values())


def test_a_replica_killed_with_50_streams_leaves_nothing_counted_busy_on_the_other(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """50 streams through replica 1 over two workers; replica 2 counts them (its view: 50 in
    flight). SIGKILL replica 1: the engines drop the streams, and within the lease (plus a sync
    and a refresh) replica 2 counts nothing in flight there, its workers' reported load is the
    engines' own (0), the dead replica's lease is gone from Redis, and replica 2 routes to both."""
    fleet = fleet_factory()
    victim, url1 = fleet.gateway()
    survivor, url2 = fleet.gateway()
    for wid in ("a", "b"):
        fleet.worker(wid, "--model", MODEL, "--option", "time_scale=1.0")
    fleet.wait_ready(url2, "a", "b")
    engines = {wid: str(w["url"]) for wid, w in fleet.workers(url2).items()}
    counts = Counts()

    streams = [HeldStream(url1, MODEL, TOKENS, f"replica stream {i}", timeout_s=60) for i in range(STREAMS)]
    for s in streams:
        assert s.first.wait(60), "no first event"
    # The preconditions: every stream is running in an engine, and replica 2 counts them all.
    assert _engines_running(engines) == STREAMS
    assert not any(s.outcome for s in streams)

    def seen_by_survivor() -> int:
        return sum(int(w["load"]["inflight"]) for w in fleet.workers(url2).values())

    wait_for(lambda: seen_by_survivor() == STREAMS, timeout=10)

    victim.kill_group(signal.SIGKILL)
    killed = time.monotonic()
    victim.popen.wait(10)
    for s in streams:
        s.thread.join(30)
        # A replica that dies cuts its clients' connections: they see it and may retry elsewhere.
        broke = s.outcome == "lost" and ("RemoteProtocolError" in s.why or "ReadError" in s.why)
        counts.add("failed" if broke else (s.outcome or "lost"), "" if broke else f"{s.name}: {s.why}")
    wait_for(lambda: _engines_running(engines) == 0, timeout=10, interval=0.1)
    engines_idle_s = time.monotonic() - killed

    def idle_on_survivor() -> bool:
        workers = fleet.workers(url2)
        return all(w["load"]["inflight"] == 0 and w["load"]["running"] == 0 and w["load"]["waiting"] == 0
                   for w in workers.values()) and set(workers) == {"a", "b"}

    wait_for(idle_on_survivor, timeout=DEFAULT_INFLIGHT_LEASE_S + 5, interval=0.05)
    idle_s = time.monotonic() - killed
    print(f"fault[replica-kill]: engines idle {engines_idle_s:.2f} s and the survivor's view idle "
          f"{idle_s:.2f} s after the SIGKILL (lease {DEFAULT_INFLIGHT_LEASE_S:g} s)")
    counts.report("replica-kill")
    assert counts.sent == STREAMS and counts.failed == STREAMS and counts.lost == 0, counts.why
    # Within the lease, give or take a sync (0.1 s) and a snapshot refresh of the engines' reports.
    assert idle_s <= DEFAULT_INFLIGHT_LEASE_S + 2.0, idle_s

    keys = Keys(fleet.prefix)
    direct = redis.Redis.from_url(fleet.redis_url)
    try:
        leases = [k.decode() for k in direct.keys(keys.inflight("*"))]  # type: ignore[union-attr]
        assert len(leases) == 1, leases  # the survivor's own
    finally:
        direct.close()
    # Nothing counted busy: the survivor routes whole loads of new work over both workers.
    served: set[str] = set()
    with httpx.Client(base_url=url2, timeout=60) as client:
        for i in range(8):
            body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"after {i}"}]}
            resp = client.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            served.add(resp.headers["x-fleetgate-worker"])
    assert served == {"a", "b"}
    wait_for(lambda: seen_by_survivor() == 0, timeout=5)
    assert survivor.alive()
