"""Every worker of a model SIGKILLed while its registry record lives on: the client gets 503 +
Retry-After with an OpenAI error that names no engine address; the gateway's log and the
admin API keep the addresses. Real gateway, agents, simulated engines and Redis."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable

import httpx

from tests.conftest import Fleet, children, wait_until

MODEL = "unreachable-model"
# host:port or a URL: what an engine's address looks like in a message.
ADDRESS = re.compile(r"\d{1,3}(\.\d{1,3}){3}:\d+|https?://|localhost")


def chat(url: str, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_every_worker_unreachable_is_a_503_that_names_no_engine(fleet_factory: Callable[[], Fleet]) -> None:
    """Two sim workers (records that outlive their agents by a minute) are SIGKILLed with their
    engines: a request, whole or streamed, is a 503 workers_unreachable with Retry-After whose
    body holds no host:port; the gateway logged each engine's address, and once the circuits
    open the admin API names it too."""
    fleet = fleet_factory()
    gateway, url = fleet.gateway()
    agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.05", "--heartbeat-ttl", "60")
              for wid in ("u1", "u2")}
    fleet.wait_ready(url, *agents)
    assert chat(url).status_code == 200
    engines = {wid: str(w["url"]) for wid, w in fleet.workers(url).items()}
    assert set(engines) == set(agents)
    for agent in agents.values():
        engine_pids = children(agent.pid)
        agent.kill_group(signal.SIGKILL)
        for pid in engine_pids:
            os.kill(pid, signal.SIGKILL)
        agent.popen.wait(10)
    for engine in engines.values():  # the precondition: nothing answers there any more
        wait_until(lambda engine=engine: _refused(engine), timeout=10)
    # Still in the registry (its TTL is a minute), so the gateway still routes to them.
    assert {w: s["state"] for w, s in fleet.workers(url).items()} == {"u1": "ready", "u2": "ready"}

    for stream in (False, True):
        resp = chat(url, stream=stream)
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"].isdigit()
        assert resp.headers["content-type"].startswith("application/json")
        err = resp.json()["error"]
        assert err["type"] == "service_unavailable" and err["code"] == "workers_unreachable", err
        assert MODEL in err["message"]
        assert not ADDRESS.search(resp.text), resp.text

    failed = [json.loads(line) for line in gateway.output().splitlines() if '"gateway.attempt_failed"' in line]
    logged = {e["worker"]: e["error"] for e in failed}
    assert set(logged) == {"u1", "u2"}
    assert all(engines[w] in error for w, error in logged.items()), logged

    # Enough failures open each worker's circuit; the admin API says where it failed.
    def circuits_open() -> bool:
        assert chat(url).status_code == 503
        return all(w["circuit"]["state"] == "open" for w in fleet.workers(url).values())

    wait_until(circuits_open, timeout=20, interval=0.2)
    for wid, worker in fleet.workers(url).items():  # host:port (a failed probe names no path)
        assert engines[wid].split("://")[1] in worker["circuit"]["reason"], worker["circuit"]


def _refused(engine: str) -> bool:
    try:
        httpx.get(f"{engine}/health", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False
