"""Hostile input and secrets: no secret in any log line, no client credential forwarded to
engines, and only genuine (signed) workers ever routed to. Schema fuzzing with every check
(no 5xx among them) is tests/e2e/test_openapi_contract.py."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from fleetgate.net import free_port
from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerInfo
from tests.conftest import ADMIN_TOKEN, Fleet, wait_until

MODEL = "sec-model"
API_KEY = "sk-live-0123456789abcdef"
SECRET = "registration-secret-xyz"


def test_no_secret_ever_reaches_a_log_line(fleet_factory: Callable[[], Fleet]) -> None:
    """API keys, the admin token and the registration secret never appear in gateway or agent logs."""
    fleet = fleet_factory()
    env = {"FLEETGATE_API_KEYS": API_KEY, "FLEETGATE_REGISTRATION_SECRET": SECRET}
    _, url = fleet.gateway(env=env)
    fleet.worker("w", "--model", MODEL, "--option", "time_scale=0.02", env={"FLEETGATE_REGISTRATION_SECRET": SECRET})
    fleet.wait_ready(url, "w")
    good = {"authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=good).status_code == 200
    assert httpx.post(f"{url}/v1/completions", json=body, headers={"authorization": "Bearer sk-wrong-key-123"}).status_code == 401
    assert httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, headers=good).status_code == 200
    assert httpx.get(f"{url}/admin/workers", headers={"authorization": "Bearer not-the-token"}).status_code == 401
    logs = "".join(p.output() for p in fleet.procs)
    assert "gateway.request" in logs
    for secret in (API_KEY, ADMIN_TOKEN, SECRET, "sk-wrong-key-123", "not-the-token"):
        assert secret not in logs


class _Capture(BaseHTTPRequestHandler):
    seen: list[dict[str, str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        _Capture.seen.append({k.lower(): v for k, v in self.headers.items()})
        body = json.dumps({"id": "x", "object": "text_completion", "choices": [{"text": "ok", "index": 0}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def capture_engine() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Capture)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _register(fleet: Fleet, url: str, secret: str, worker_id: str, model: str) -> None:
    async def go() -> None:
        redis = connect(fleet.redis_url)
        registry = Registry(redis, fleet.prefix, heartbeat_ttl_s=30, secret=secret)
        info = WorkerInfo(id=worker_id, url=url, engine="vllm", model=model)
        await registry.register(info, "ready")
        await redis.aclose()

    asyncio.run(go())


def test_client_credentials_and_hop_by_hop_headers_are_not_forwarded(
    fleet_factory: Callable[[], Fleet], capture_engine: str
) -> None:
    """The engine sees the body and content type, never the client's Authorization or hop-by-hop headers."""
    fleet = fleet_factory()
    _, url = fleet.gateway(env={"FLEETGATE_API_KEYS": API_KEY})
    _register(fleet, capture_engine, "", "capture", "cap-model")
    headers = {"authorization": f"Bearer {API_KEY}", "connection": "keep-alive, x-hop", "x-hop": "1",
               "proxy-authorization": "Basic abc", "te": "trailers", "cookie": "session=1"}
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        resp = httpx.post(f"{url}/v1/completions", json={"model": "cap-model", "prompt": "x"}, headers=headers)
        if resp.status_code == 200:
            break
        time.sleep(0.1)
    assert resp.status_code == 200
    seen = _Capture.seen[-1]
    for name in ("authorization", "proxy-authorization", "x-hop", "te", "cookie"):
        assert name not in seen
    assert seen["content-type"] == "application/json"


def test_only_signed_workers_are_routed_to(fleet_factory: Callable[[], Fleet], capture_engine: str) -> None:
    """With a registration secret, a record written without it (say, pointing at a metadata service)
    is invisible: the gateway never forwards to an address a genuine agent did not register."""
    fleet = fleet_factory()
    _, url = fleet.gateway(env={"FLEETGATE_REGISTRATION_SECRET": SECRET})
    _register(fleet, "http://169.254.169.254", "", "forged", "forged-model")
    _register(fleet, capture_engine, SECRET, "genuine", "genuine-model")
    import time

    time.sleep(1.5)
    assert httpx.post(f"{url}/v1/completions", json={"model": "forged-model", "prompt": "x"}).status_code == 404
    assert httpx.post(f"{url}/v1/completions", json={"model": "genuine-model", "prompt": "x"}).status_code == 200
    ids = [w["id"] for w in fleet.workers(url).values()]
    assert ids == ["genuine"]


def test_open_data_plane_beyond_loopback_is_warned_at_start_and_on_health(fleet_factory: Callable[[], Fleet]) -> None:
    """Bound to 0.0.0.0 with no API key: a warning at start and on /health; with a key, or on
    loopback (make demo), none."""
    fleet = fleet_factory()
    open_proc, open_url = fleet.gateway("--host", "0.0.0.0")
    keyed_proc, keyed_url = fleet.gateway("--host", "0.0.0.0", env={"FLEETGATE_API_KEYS": API_KEY})
    local_proc, local_url = fleet.gateway()  # 127.0.0.1, as make demo runs it
    warnings = httpx.get(f"{open_url}/health").json()["warnings"]
    assert len(warnings) == 1 and "FLEETGATE_API_KEYS" in warnings[0] and "0.0.0.0" in warnings[0]
    assert [json.loads(x)["level"] for x in open_proc.output().splitlines()
            if '"gateway.open_data_plane"' in x] == ["warning"]
    for proc, url in ((keyed_proc, keyed_url), (local_proc, local_url)):
        assert "warnings" not in httpx.get(f"{url}/health").json()
        assert "gateway.open_data_plane" not in proc.output()


def test_agent_without_the_registration_secret_is_logged_told_and_exits(fleet_factory: Callable[[], Fleet]) -> None:
    """A real agent with no secret, and one with another secret, in front of a gateway that has one:
    the gateway logs each rejected record (once, not every refresh) and writes why under a
    registry key; each agent reads it, logs agent.rejected and exits non-zero within ~10 s,
    saying to set the gateways' registration secret, its engine stopped; the genuine worker serves."""
    import time

    fleet = fleet_factory()
    proc, url = fleet.gateway(env={"FLEETGATE_REGISTRATION_SECRET": SECRET})
    fast = ("--model", MODEL, "--option", "time_scale=0.02")
    fleet.worker("genuine", *fast, env={"FLEETGATE_REGISTRATION_SECRET": SECRET})
    fleet.wait_ready(url, "genuine")  # first: wait_ready fails on any agent that exited
    started = time.monotonic()
    nosecret = fleet.worker("nosecret", *fast)
    wrongsecret = fleet.worker("wrongsecret", *fast, env={"FLEETGATE_REGISTRATION_SECRET": "another-secret"})
    # The engine starts before the first registration, so before any gateway can reject it;
    # each agent logs its engine's pid (agent.engine_started), read back once the agent is gone.
    for agent in (nosecret, wrongsecret):
        assert agent.popen.wait(max(0.1, 30 - (time.monotonic() - started))) == 1
        out = agent.output()
        assert '"agent.rejected"' in out, out[-3000:]
        assert "set FLEETGATE_REGISTRATION_SECRET for this agent to the same registration secret as the gateways" in out
        events = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        names = [e.get("event") for e in events]
        assert names.index("agent.engine_started") < names.index("agent.rejected") < names.index("agent.engine_stopped")
        engine_pid = next(e["pid"] for e in events if e.get("event") == "agent.engine_started")
        with pytest.raises(ProcessLookupError):  # stopped before the agent exited
            os.kill(engine_pid, 0)

    def rejected() -> dict[str, str]:
        lines = [json.loads(x) for x in proc.output().splitlines() if '"gateway.worker_rejected"' in x]
        return {line["worker"]: line["reason"] for line in lines}

    seen = wait_until(lambda: len(rejected()) == 2 and rejected(), timeout=30)
    assert seen == {"nosecret": "not signed (no registration secret)",
                    "wrongsecret": "signed with another registration secret"}
    time.sleep(3)  # three more refreshes: still one line each
    lines = [x for x in proc.output().splitlines() if '"gateway.worker_rejected"' in x]
    assert len(lines) == 2

    async def told(worker_id: str) -> str | None:
        redis = connect(fleet.redis_url)
        try:
            return await Registry(redis, fleet.prefix).rejection(worker_id)
        finally:
            await redis.aclose()

    assert asyncio.run(told("nosecret")) == "not signed (no registration secret)"
    assert asyncio.run(told("genuine")) is None
    assert set(fleet.workers(url)) == {"genuine"}
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body).headers["x-fleetgate-worker"] == "genuine"


def test_a_gateway_that_turns_up_later_with_a_secret_does_not_stop_a_serving_worker(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """Agents look for rejections only while starting and a few seconds after turning ready: a
    gateway started later with a secret logs the unsigned record, and the worker keeps serving
    the gateway without one."""
    import time

    from workers.registration import REJECTION_WATCH_S

    fleet = fleet_factory()
    _, open_url = fleet.gateway()
    agent = fleet.worker("w", "--model", MODEL, "--option", "time_scale=0.02")
    fleet.wait_ready(open_url, "w")
    time.sleep(REJECTION_WATCH_S + 1)
    strict, _ = fleet.gateway(env={"FLEETGATE_REGISTRATION_SECRET": SECRET})
    wait_until(lambda: '"gateway.worker_rejected"' in strict.output(), timeout=10)
    time.sleep(3)
    assert agent.alive() and '"agent.rejected"' not in agent.output()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{open_url}/v1/completions", json=body).status_code == 200


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
