"""A gateway cut off from Redis (a TCP proxy between it and Redis, cut then healed): it keeps
routing to the workers it knows, admin writes answer 503 with a clear OpenAI error, and once
healed it sees the fleet (a worker that joined meanwhile included) and takes writes again, with
no restart. Real Redis, gateway, agents and simulated engines."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import httpx

from tests.conftest import ADMIN_TOKEN, Fleet
from tests.e2e.faults import ADDRESS, Counts, TcpProxy, wait_for

MODEL = "fault-gateway-model"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
# Every kind of admin write: a worker's drain, undrain and removal, an alias, a team, a key.
WRITES: list[tuple[str, str, dict[str, object] | None]] = [
    ("POST", "/admin/workers/a/drain", None),
    ("POST", "/admin/workers/a/undrain", None),
    ("DELETE", "/admin/workers/b", None),
    ("PUT", "/admin/aliases/fault-alias", {"targets": [{"model": MODEL}]}),
    ("PUT", "/admin/teams/fault-team", {}),
    ("PUT", "/admin/keys/fault-key", {}),
]


def _chat(client: httpx.Client, i: int, counts: Counts) -> str:
    body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"request {i}"}]}
    try:
        resp = client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        counts.add("lost", repr(exc))
        return ""
    if resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4:
        counts.add("ok")
    else:
        counts.add("failed", f"{resp.status_code} {resp.text[:200]}")
    return resp.headers.get("x-fleetgate-worker", "")


def test_gateway_cut_off_from_redis_routes_to_known_workers_and_refuses_writes_clearly(
    fleet_factory: Callable[[], Fleet], tmp_path: Path,
) -> None:
    """The gateway reaches Redis only through a proxy. Cut: for longer than a record's TTL and the
    in-flight lease, every request is served by the workers it knew; each admin write (and the
    admin list, which reads Redis) is a 503 `registry_unavailable` with Retry-After, in OpenAI's
    shape, naming no address. Healed: health is ok again, a worker that registered during the cut
    is routed to, and the writes go through."""
    fleet = fleet_factory()
    target = urlparse(fleet.redis_url)
    proxy = TcpProxy(target.hostname or "127.0.0.1", target.port or 6379)
    cut_side = Fleet(proxy.url(int(target.path.strip("/") or 0)), fleet.prefix, tmp_path)
    counts = Counts()
    try:
        gateway, url = cut_side.gateway()
        for wid in ("a", "b"):
            fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.05")
        fleet.wait_ready(url, "a", "b")
        assert proxy.connections > 0

        with httpx.Client(base_url=url, timeout=30) as client:
            proxy.cut()
            wait_for(lambda: client.get("/health").json()["status"] == "degraded", timeout=10)
            # A worker that joins while the gateway cannot see it: found once healed.
            fleet.worker("c", "--model", MODEL, "--option", "time_scale=0.05")
            served: set[str] = set()
            i = 0
            # Until the gateway's view is older than a record's TTL and the in-flight lease (3 s):
            # past the point where anything it read could still be live in Redis.
            while (client.get("/health").json()["snapshot_age_s"] or 0) < 4.5 or i < 20:
                served.add(_chat(client, i, counts))
                i += 1
            health = client.get("/health").json()
            assert health["status"] == "degraded" and health["ready_workers"] == 2, health
            assert served == {"a", "b"}, served

            refusals = [client.request(m, p, json=b, headers=ADMIN) for m, p, b in WRITES]
            refusals.append(client.get("/admin/workers", headers=ADMIN))
            for (method, path, _), resp in zip([*WRITES, ("GET", "/admin/workers", None)], refusals, strict=True):
                assert resp.status_code == 503, (method, path, resp.status_code, resp.text)
                assert resp.headers["retry-after"].isdigit()
                assert resp.headers["content-type"].startswith("application/json")
                error = resp.json()["error"]
                assert error["code"] == "registry_unavailable" and error["type"] == "service_unavailable", error
                assert "registry" in error["message"] and set(error) == {"message", "type", "param", "code"}
                assert not ADDRESS.search(resp.text), resp.text
            # Still serving after the refusals.
            assert _chat(client, i, counts) in {"a", "b"}

            proxy.heal()
            healed = time.monotonic()
            wait_for(lambda: client.get("/health").json()["status"] == "ok", timeout=10)
            back_s = time.monotonic() - healed
            fleet.wait_ready(url, "c", timeout=30)
            wait_for(lambda: _chat(client, 1000 + len(served), counts) == "c", timeout=20, interval=0)
            writes = [client.request(m, p, json=b, headers=ADMIN) for m, p, b in WRITES]
            assert [r.status_code for r in writes] == [200, 200, 200, 201, 201, 201], [r.text for r in writes]
        print(f"fault[gateway-redis-cut]: {len(refusals)} admin calls refused with 503 during the cut, "
              f"health ok {back_s:.2f} s after the heal")
        counts.report("gateway-redis-cut")
        assert counts.failed == 0 and counts.lost == 0 and counts.ok == counts.sent, counts.why
        assert gateway.alive() and "gateway.registry_connected" in gateway.output()
    finally:
        cut_side.close()
        proxy.close()
