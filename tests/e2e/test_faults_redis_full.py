"""Redis at maxmemory with noeviction (a Redis of the test's own): writes are refused, the fleet
keeps serving (whole and streamed chats, Responses API creates, with rate limits on), each part
says so in one log line per outage, not one per request or heartbeat, and all comes back once
memory frees. Real Redis, gateway, agents and simulated engines."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from fleetgate.registry import Keys
from fleetgate_tools.redis_server import EmbeddedRedis
from tests.conftest import Fleet, Proc
from tests.e2e.faults import Counts, wait_for

MODEL = "fault-full-model"
TTL_S = 3.0
BALLAST = 256 * 1024
BALLASTS = 8
STORE = ("--model", MODEL, "--option", "time_scale=0.05", "--option", "env={VLLM_ENABLE_RESPONSES_API_STORE: 1}")


@pytest.fixture
def server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


def _oom(client: redis.Redis) -> bool:
    """Whether Redis refuses a write for want of memory."""
    try:
        client.set("fault:probe", "x")
    except redis.exceptions.OutOfMemoryError:
        return True
    return False


def _fill(client: redis.Redis) -> int:
    """Ballast of BALLASTS keys, then maxmemory two of them below what Redis uses, noeviction: a
    margin no other client's writes and frees can cross; deleting the ballast frees six keys' worth
    below the limit. The number of ballast keys."""
    client.config_set("maxmemory-policy", "noeviction")
    for n in range(BALLASTS):
        client.set(f"fault:ballast:{n}", b"x" * BALLAST)
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 2 * BALLAST)
    return BALLASTS


def _request(client: httpx.Client, kind: str, i: int, counts: Counts) -> str:
    """One request of `kind` (chat, stream, response); the response id for a Responses create."""
    text = f"request {i} while Redis is full"
    try:
        if kind == "response":
            resp = client.post("/v1/responses", json={"model": MODEL, "input": text, "max_output_tokens": 4})
            ok = resp.status_code == 200 and resp.json()["output"]
        elif kind == "chat":
            resp = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 4, "ignore_eos": True, "messages": [{"role": "user", "content": text}]})
            ok = resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        else:
            body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": text}]}
            with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                resp.read()
                lines = [line for line in resp.text.splitlines() if line.startswith("data: ")] or [""]
            ok = resp.status_code == 200 and lines[-1] == "data: [DONE]" and not any('"error"' in x for x in lines)
    except httpx.HTTPError as exc:
        counts.add("lost", f"{kind}: {exc!r}")
        return ""
    counts.add("ok" if ok else "failed", "" if ok else f"{kind}: {resp.status_code} {resp.text[:200]}")
    return str(resp.json()["id"]) if ok and kind == "response" else ""


def _warnings(procs: list[Proc], since: float) -> Counter[str]:
    """Warning and error events per (process log, event) logged since unix time `since`."""
    seen: Counter[str] = Counter()
    for proc in procs:
        for line in proc.output().splitlines():
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            stamp = event.get("timestamp", "")
            if event.get("level") in ("warning", "error") and stamp and _unix(stamp) >= since:
                seen[f"{proc.log_path.stem}:{event['event']}"] += 1
    return seen


def _unix(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_redis_at_maxmemory_refuses_writes_while_serving_goes_on(server: EmbeddedRedis, tmp_path: Path) -> None:
    """Redis is filled to its maxmemory (noeviction) and stays full for longer than a worker
    record's TTL: no request fails or hangs, no worker leaves the fleet, each process logs each
    failing write once, not per request or heartbeat; once the ballast is deleted, heartbeats,
    rate limits, stored responses and admin writes work again."""
    fleet = Fleet(server.url, f"fgtest-{uuid.uuid4().hex[:8]}", tmp_path)
    direct = redis.Redis(port=server.port)
    counts = Counts()
    try:
        gateway, url = fleet.gateway("--set", "rate_limit_rpm=100000", "--set", f"heartbeat_ttl_s={TTL_S}")
        for wid in ("a", "b"):
            fleet.worker(wid, *STORE, "--heartbeat-ttl", str(TTL_S))
        fleet.wait_ready(url, "a", "b")
        keys = Keys(fleet.prefix)
        with httpx.Client(base_url=url, timeout=30) as client:
            assert _request(client, "response", 0, counts)

            full_at = time.time()
            ballast = _fill(direct)
            assert ballast > 0 and _oom(direct)  # the precondition: Redis refuses writes now
            kinds = ("chat", "stream", "response")
            i = 0
            # Until both records would have expired twice over, had nothing kept them.
            while time.time() - full_at < 2 * TTL_S + 1 or i < 60:
                _request(client, kinds[i % 3], i, counts)
                i += 1
            assert _oom(direct)
            during = fleet.workers(url)
            assert {w: s["state"] for w, s in during.items()} == {"a": "ready", "b": "ready"}, during
            # The agents could not write their load: the registry's heartbeat is as old as the fill.
            beats = [float(direct.hget(keys.worker(w), "hb") or 0) for w in ("a", "b")]
            assert max(beats) < full_at + 1.5, (beats, full_at)
            warned = _warnings(fleet.procs, full_at)
            counts.report("redis-maxmemory")
            assert counts.ok == counts.sent and counts.sent >= 60, counts.why
            # One line per outage and failing part, not one per request (60+) or heartbeat (6+).
            assert warned and max(warned.values()) <= 2, warned

            for n in range(ballast):
                direct.delete(f"fault:ballast:{n}")
            freed_at = time.time()
            assert not _oom(direct)
            wait_for(lambda: min(float(direct.hget(keys.worker(w), "hb") or 0) for w in ("a", "b")) > freed_at,
                     timeout=10)
            resp = client.post("/v1/chat/completions", json={
                "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "after"}]})
            assert resp.status_code == 200 and "x-ratelimit-remaining-requests" in resp.headers
            response_id = _request(client, "response", 1000, counts)
            assert client.get(f"/v1/responses/{response_id}").status_code == 200
            with fleet.admin(url) as admin:
                assert admin.post("/admin/workers/a/drain").status_code == 200
                assert admin.post("/admin/workers/a/undrain").status_code == 200
        out = gateway.output()
        assert "gateway.inflight_sync_resumed" in out, out[-3000:]
    finally:
        direct.close()
        fleet.close()
