"""KV cache events through a real agent: it starts the simulator with `--kv-events-config`,
subscribes, and publishes the index to Redis, where a gateway's mirror reads it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import httpx

from fleetgate.kv_index import chain_keys
from fleetgate.kv_registry import KvMirror
from fleetgate.registry import Registry, connect
from tests.conftest import Fleet, children, until

MODEL = "kv-model"


async def test_an_agent_publishes_its_engines_cache_and_says_when_it_is_lost(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """A served prompt's blocks reach the mirror under its chain keys; a frozen engine (no
    batch, no replay answer) reads "lost" within about a second and "events" once it thaws;
    an LMDeploy-flavoured worker publishes nothing."""
    fleet = fleet_factory()
    agent = fleet.worker("w", "--model", MODEL, "--option", "time_scale=0.05", "--option", "block_size=16")
    fleet.worker("lm", "--model", MODEL, "--option", "time_scale=0.05", "--option", "flavor=lmdeploy")
    redis = connect(fleet.redis_url)
    registry = Registry(redis, fleet.prefix)
    mirror = KvMirror(fleet.prefix)
    refresher = asyncio.create_task(mirror.run(redis, lambda: ["w", "lm"], interval_s=0.05))
    try:
        urls: dict[str, str] = {}

        async def ready() -> bool:
            views = await registry.read_all()
            urls.update({v.id: v.info.url for v in views if v.state == "ready"})
            return {"w", "lm"} <= set(urls)

        deadline = time.monotonic() + 60
        while not await ready():
            assert time.monotonic() < deadline and agent.alive(), agent.output()
            await asyncio.sleep(0.2)
        await until(lambda: mirror.get("w") is not None)
        assert mirror.status("lm") is None

        prompt = "Shared system prompt for every tenant of this fleet. " * 12
        async with httpx.AsyncClient(base_url=urls["w"], timeout=30) as client:
            ids = (await client.post("/tokenize", json={"model": MODEL, "prompt": prompt})).json()["tokens"]
            resp = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
            assert resp.status_code == 200
        keys = chain_keys(ids, 16)
        await until(lambda: (w := mirror.get("w")) is not None and w.cached_blocks(keys) == len(keys))

        [engine_pid] = children(agent.pid)
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            took = await until(lambda: mirror.get("w") is None)
            status = mirror.status("w")
            assert status is not None and "silent" in status.reason
            print(f"a frozen engine read lost in the mirror after {took:.2f} s")
            assert took < 3.0
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        await until(lambda: (w := mirror.get("w")) is not None and w.cached_blocks(keys) == len(keys))
    finally:
        refresher.cancel()
        await redis.aclose()


def test_the_gateway_lists_each_workers_index_from_its_engines_events(fleet_factory: Callable[[], Fleet]) -> None:
    """GET /admin/workers shows what the gateway's mirror holds: a vLLM-like worker's index
    grows by the blocks of a prompt it served; an LMDeploy-flavoured worker has none."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("w", "--model", MODEL, "--option", "time_scale=0.05", "--option", "block_size=16")
    fleet.worker("lm", "--model", "lm-model", "--option", "time_scale=0.05", "--option", "flavor=lmdeploy")
    fleet.wait_ready(url, "w", "lm")

    def kv(wid: str) -> dict[str, object] | None:
        return fleet.workers(url)[wid]["kv_events"]  # type: ignore[return-value]

    deadline = time.monotonic() + 30
    while (before := kv("w")) is None or before["state"] != "events":
        assert time.monotonic() < deadline, before
        time.sleep(0.1)
    prompt = "A long shared system prompt, the same for every request of a tenant. " * 16
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}, timeout=30)
    assert resp.status_code == 200 and resp.headers["x-fleetgate-worker"] == "w"
    while (after := kv("w")) is None or int(after["blocks"]) < int(before["blocks"]) + 8:  # type: ignore[call-overload]
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert after["state"] == "events" and after["block_size"] == 16 and after["reason"] == ""
    assert kv("lm") is None


def test_an_attached_engines_events_reach_the_gateway(fleet_factory: Callable[[], Fleet]) -> None:
    """An engine someone else started with its own `--kv-events-config` (binding its sockets,
    as vLLM does for `tcp://*:PORT`), attached the README's way (`--engine external`) with
    `--kv-events/--kv-replay/--kv-topic`: its index reaches the gateway and grows with what
    it serves."""
    import json
    import sys

    from fleetgate.net import free_port
    from tests.e2e.test_simulator import Sim

    fleet = fleet_factory()
    _, url = fleet.gateway()
    port, events, replay = free_port(), free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}
    engine = Sim([sys.executable, "-m", "workers.simulator", "--port", str(port), "--served-model-name", MODEL,
                  "--block-size", "16", "--time-scale", "0.05", "--kv-events-config", json.dumps(config)], port)
    try:
        fleet.worker("ext", "--url", engine.url, "--flavor", "sim",
                     "--kv-events", f"tcp://127.0.0.1:{events}", "--kv-replay", f"tcp://127.0.0.1:{replay}",
                     "--kv-topic", "kv", engine="external")
        fleet.wait_ready(url, "ext")
        deadline = time.monotonic() + 30
        while (kv := fleet.workers(url)["ext"]["kv_events"]) is None or kv["state"] != "events":  # type: ignore[index]
            assert time.monotonic() < deadline, kv
            time.sleep(0.1)
        prompt = "An attached engine's cache, seen through its own events. " * 16
        resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}, timeout=30)
        assert resp.status_code == 200 and resp.headers["x-fleetgate-worker"] == "ext"
        while int((kv := fleet.workers(url)["ext"]["kv_events"])["blocks"]) < 8:  # type: ignore[index]
            assert time.monotonic() < deadline, kv
            time.sleep(0.1)
    finally:
        engine.stop()
