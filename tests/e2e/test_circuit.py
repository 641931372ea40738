"""Circuit breakers against engines that are sick but still answer /health, and engines that are
only full: a real gateway and agents, simulated engines with injected faults, and a scripted
engine (a real HTTP server) for answers the simulator does not give."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from fleetgate.net import free_port
from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerInfo
from tests.conftest import Fleet, wait_until

MODEL = "cb-model"


def circuit(fleet: Fleet, url: str, worker: str) -> str:
    return str(fleet.workers(url)[worker]["circuit"]["state"])


def open_events(fleet: Fleet) -> list[dict[str, object]]:
    lines = fleet.procs[0].output().splitlines()
    return [json.loads(x) for x in lines if '"gateway.circuit_open"' in x]


def test_sick_engine_stays_out_with_growing_cooldowns_until_it_heals(fleet_factory: Callable[[], Fleet]) -> None:
    """An engine failing every request (but answering /health) stays out of routing: the probe is a
    real request, each failed probe doubles the cooldown up to the cap; once healed it is closed."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "breaker_cooldown_s=0.5", "--set", "breaker_max_cooldown_s=2",
                           "--policy", "round_robin")
    # No warm-up: it would fail on this engine, and a failed warm-up is a failed start.
    fleet.worker("sick", "--model", MODEL, "--option", "time_scale=0.05", "--option", "faults=[error_rate=1.0]",
                 "--no-warmup")
    fleet.worker("well", "--model", MODEL, "--option", "time_scale=0.05")
    fleet.wait_ready(url, "sick", "well")
    sick_url = str(fleet.workers(url)["sick"]["url"])
    assert httpx.get(f"{sick_url}/health").status_code == 200  # what the old probe asked
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert [httpx.post(f"{url}/v1/completions", json=body).status_code for _ in range(8)] == [200] * 8
    wait_until(lambda: circuit(fleet, url, "sick") == "open", timeout=5)
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        assert circuit(fleet, url, "sick") == "open"
        time.sleep(0.1)
    cooldowns = [e["cooldown_s"] for e in open_events(fleet)]
    assert cooldowns[:4] == [0.5, 1.0, 2.0, 2.0], cooldowns
    httpx.post(f"{sick_url}/sim/faults", json={"error_rate": None})
    wait_until(lambda: circuit(fleet, url, "sick") == "closed", timeout=6)
    assert "gateway.circuit_probe_failed" in fleet.procs[0].output()


class _Scripted(BaseHTTPRequestHandler):
    """An engine that answers by the prompt: `busy` 429, `bad` 400, `boom` 500, else a completion."""

    answers = {"busy": 429, "bad": 400, "boom": 500}
    seen: list[str] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
        prompt = str(body.get("prompt", ""))
        _Scripted.seen.append(prompt)
        status = self.answers.get(prompt, 200)
        if status == 200:
            out = {"id": "c", "object": "text_completion", "model": MODEL,
                   "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
        else:
            out = {"error": {"message": prompt, "type": "x", "param": None, "code": status}}
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Scripted)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Scripted.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _register(fleet: Fleet, url: str, worker_id: str) -> None:
    async def go() -> None:
        redis = connect(fleet.redis_url)
        await Registry(redis, fleet.prefix, heartbeat_ttl_s=60).register(
            WorkerInfo(id=worker_id, url=url, engine="vllm", model=MODEL), "ready")
        await redis.aclose()

    asyncio.run(go())


def test_engine_429_and_client_4xx_never_count_against_the_engine(
    fleet_factory: Callable[[], Fleet], scripted: str,
) -> None:
    """Five 429s in a row leave the circuit closed (the client gets 429 + Retry-After, not 502);
    a 4xx between two 5xx does not reset the count (500, 400, 500, 500 opens it)."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    _register(fleet, scripted, "scripted")
    completions = f"{url}/v1/completions"
    wait_until(lambda: httpx.post(completions, json={"model": MODEL, "prompt": "hi"}).status_code == 200, timeout=5)
    for _ in range(5):
        resp = httpx.post(completions, json={"model": MODEL, "prompt": "busy"})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    time.sleep(0.3)
    assert circuit(fleet, url, "scripted") == "closed"
    statuses = [httpx.post(completions, json={"model": MODEL, "prompt": p}).status_code
                for p in ("boom", "bad", "boom", "boom")]
    assert statuses == [502, 400, 502, 502]
    wait_until(lambda: circuit(fleet, url, "scripted") == "open", timeout=3)
