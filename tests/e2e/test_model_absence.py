"""A model no worker serves right now: 503 + Retry-After (which clients retry) when the fleet
served it recently or the gateway cannot read its registry; 404 only for a model never served.
Real gateway, agents, simulated engines, and a real Redis that is not there at first."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from fleetgate_tools.redis_server import EmbeddedRedis, free_port
from tests.conftest import Fleet, wait_until

MODEL = "absent-model"
FAST = ("--model", MODEL, "--option", "time_scale=0.05")


def chat(url: str, model: str = MODEL) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_model_whose_workers_left_is_503_until_forgotten_then_404(fleet_factory: Callable[[], Fleet]) -> None:
    """Its only worker leaves: 503 model_unavailable + Retry-After (the openai client's retries then
    reach a worker that comes back); a never-served name is 404; once forgotten, 404 again."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "model_memory_s=6")
    first = fleet.worker("first", *FAST)
    fleet.wait_ready(url, "first")
    assert chat(url).status_code == 200
    first.stop()  # SIGTERM: the agent drains and deregisters
    wait_until(lambda: "first" not in fleet.workers(url), timeout=10)
    wait_until(lambda: chat(url).status_code != 200, timeout=3)
    resp = chat(url)
    assert resp.status_code == 503 and resp.headers["retry-after"].isdigit()
    err = resp.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "model_unavailable" and err["param"] == "model"
    never = chat(url, "never-served")
    assert never.status_code == 404 and never.json()["error"]["code"] == "model_not_found"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    # A worker comes back while the client retries (the openai client honours Retry-After).
    threading.Timer(0.5, lambda: fleet.worker("second", *FAST)).start()
    retrying = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=4)
    answer = retrying.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert answer.headers["x-fleetgate-worker"] == "second"
    fleet.procs[-1].stop()
    wait_until(lambda: "second" not in fleet.workers(url), timeout=10)
    assert chat(url).status_code == 503
    wait_until(lambda: chat(url).status_code == 404, timeout=10)  # forgotten after model_memory_s


def test_gateway_without_redis_answers_503_then_serves_once_it_reads_the_registry(tmp_path: Path) -> None:
    """A gateway started while Redis is down says 503 registry_unavailable for every model (not 404),
    serves once Redis is up, and while Redis is down again keeps serving what it knew, 503 for the rest."""
    port = free_port()
    fleet = Fleet(f"redis://127.0.0.1:{port}/0", f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path)
    redis = EmbeddedRedis(port)
    try:
        _, url = fleet.gateway()
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "degraded" and health["snapshot_age_s"] is None
        for model in (MODEL, "anything"):
            resp = chat(url, model)
            assert resp.status_code == 503 and resp.headers["retry-after"].isdigit()
            assert resp.json()["error"]["code"] == "registry_unavailable"
        redis.start()
        fleet.worker("w", *FAST)
        fleet.wait_ready(url, "w")
        assert chat(url).status_code == 200
        assert chat(url, "never-served").status_code == 404
        redis.stop()
        wait_until(lambda: httpx.get(f"{url}/health").json()["status"] == "degraded", timeout=10)
        time.sleep(0.2)
        assert chat(url).status_code == 200  # routed on the last snapshot
        other = chat(url, "never-served")
        assert other.status_code == 503 and other.json()["error"]["code"] == "registry_unavailable"
    finally:
        fleet.close()
        redis.stop()
