"""Per-client rate limits: a GCRA cell per client in the real Redis, shared by gateway replicas."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import httpx
import openai
import pytest

from fleetgate.registry import Registry, connect
from tests.conftest import Fleet

MODEL = "base-model"
FAST = ("--model", MODEL, "--option", "time_scale=0.02")


@pytest.mark.parametrize(
    ("per_minute", "burst"),
    [
        (20, 3),  # a burst of 3, then the fourth waits ~3 s
        (20, 1),  # no burst: one, then a wait of ~3 s
        (6, 10),  # a burst of 10, then the eleventh waits ~10 s (not slept: the others do)
    ],
)
def test_gcra_cell_allows_the_burst_then_refuses(redis_url: str, per_minute: float, burst: int) -> None:
    """The cell's refill interval is far longer than the burst's round trips take on a busy
    machine (a refill during the burst would let the last call through); the test checks
    that its burst did fit in one interval before it reads the verdicts."""
    interval = 60 / per_minute

    async def go() -> None:
        client = connect(redis_url)
        registry = Registry(client, f"rl-{uuid.uuid4().hex[:8]}")
        loop = asyncio.get_running_loop()
        began = loop.time()
        results = [await registry.take("key:a", per_minute, burst) for _ in range(burst + 1)]
        took = loop.time() - began
        assert took < interval / 2, f"the precondition: {burst + 1} calls took {took:.3f} s of a {interval} s interval"
        assert [ok for ok, _, _ in results] == [True] * burst + [False]
        assert [left for _, left, _ in results[:-1]] == list(range(burst - 1, -1, -1))
        wait = results[-1][2]
        assert interval - took - 0.01 <= wait <= interval + 0.01
        # Another client has its own cell.
        assert (await registry.take("key:b", per_minute, burst))[0]
        if wait < 4:
            await asyncio.sleep(wait + 0.02)
            assert (await registry.take("key:a", per_minute, burst))[0]
        await client.aclose()

    asyncio.run(go())


def test_gateways_share_each_keys_limit(fleet_factory: Callable[[], Fleet]) -> None:
    """Two replicas, one limit per API key: the third request of a burst of two gets OpenAI's
    429 (type `requests`, code `rate_limit_exceeded`) with Retry-After and x-ratelimit-*
    headers, whichever replica it reaches; another key is not affected."""
    fleet = fleet_factory()
    env = {"FLEETGATE_API_KEYS": "sk-one,sk-two"}
    limits = ("--set", "rate_limit_rpm=2", "--set", "rate_limit_burst=2")  # one back every 30 s
    _, url1 = fleet.gateway(*limits, env=env)
    _, url2 = fleet.gateway(*limits, "--set", "fast_path=false", env=env)  # both code paths
    fleet.worker("w", *FAST)
    fleet.wait_ready(url1, "w")
    fleet.wait_ready(url2, "w")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    one = {"authorization": "Bearer sk-one"}
    first = httpx.post(f"{url1}/v1/completions", json=body, headers=one)
    second = httpx.post(f"{url2}/v1/completions", json=body, headers=one)
    assert (first.status_code, second.status_code) == (200, 200)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert [r.headers["x-ratelimit-remaining-requests"] for r in (first, second)] == ["1", "0"]
    third = httpx.post(f"{url1}/v1/completions", json=body, headers=one)
    assert third.status_code == 429
    assert third.json()["error"]["type"] == "requests"
    assert third.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(third.headers["retry-after"]) <= 30
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    # The official client sees its own RateLimitError; the other key still gets through.
    client = openai.OpenAI(base_url=f"{url2}/v1", api_key="sk-one", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    other = openai.OpenAI(base_url=f"{url2}/v1", api_key="sk-two", max_retries=0)
    assert other.completions.create(model=MODEL, prompt="x", max_tokens=2).choices
    # Streams are limited the same way.
    stream = httpx.post(f"{url1}/v1/chat/completions", headers=one,
                        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert stream.status_code == 429


def test_no_limit_by_default_and_no_headers(fleet_factory: Callable[[], Fleet]) -> None:
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("w", *FAST)
    fleet.wait_ready(url, "w")
    replies = [httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
               for _ in range(5)]
    assert [r.status_code for r in replies] == [200] * 5
    assert "x-ratelimit-limit-requests" not in replies[0].headers


def test_an_open_gateway_limits_each_address_behind_a_trusted_proxy(fleet_factory: Callable[[], Fleet]) -> None:
    """Without keys the limit is per client address; behind a proxy on 127.0.0.1 (uvicorn's
    default trusted one) that is X-Forwarded-For's, on the proxied routes' own path and on
    Litestar's alike: one address's burst spent leaves another's whole."""
    fleet = fleet_factory()
    limits = ("--set", "rate_limit_rpm=2", "--set", "rate_limit_burst=1")
    _, fast = fleet.gateway(*limits)
    _, slow = fleet.gateway(*limits, "--set", "fast_path=false")
    fleet.worker("w", *FAST)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for n, url in enumerate((fast, slow)):
        fleet.wait_ready(url, "w")
        a, b = {"x-forwarded-for": f"10.0.{n}.1"}, {"x-forwarded-for": f"10.0.{n}.2"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=a).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=body, headers=a).status_code == 429
        assert httpx.post(f"{url}/v1/completions", json=body, headers=b).status_code == 200
