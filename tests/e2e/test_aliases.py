"""Aliases and fallbacks end to end: a real gateway, simulated workers, real Redis.

An alias splits traffic by its weights over models the fleet serves (a base model and a
LoRA adapter here); a fallback answers when the requested model's workers leave or its
context is too small; the answer names the model that produced it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.conftest import Fleet, wait_until

FAST = ("--option", "time_scale=0.05")


def _config(tmp_path: Path, **gateway: object) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"gateway": gateway}))
    return str(path)


@pytest.fixture
def fleet(fleet_factory: Callable[[], Fleet], tmp_path: Path) -> Iterator[tuple[Fleet, str]]:
    """alpha (with adapter `tuned`) and beta, 8k context; small-ctx with 256 tokens of context."""
    fleet = fleet_factory()
    config = _config(
        tmp_path,
        aliases={"chat": [{"model": "alpha", "weight": 80}, {"model": "beta", "weight": 20}],
                 "canary": [{"model": "alpha", "weight": 1}, {"model": "tuned", "weight": 1}]},
        fallbacks={"alpha": ["beta"], "small-ctx": ["beta"]},
    )
    _, url = fleet.gateway("--config", config)
    fleet.alpha = fleet.worker(  # type: ignore[attr-defined]
        "a", "--model", "alpha", "--adapters", "tuned=/adapters/tuned", "--max-model-len", "8192", *FAST)
    fleet.worker("b", "--model", "beta", "--max-model-len", "8192", *FAST)
    fleet.worker("s", "--model", "small-ctx", "--max-model-len", "256", *FAST)
    fleet.wait_ready(url, "a", "b", "s")
    yield fleet, url


def _chat(url: str, model: str, content: str = "hi", **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def test_alias_splits_traffic_by_weight(fleet: tuple[Fleet, str]) -> None:
    """200 requests to `chat` (80 alpha / 20 beta): alpha answers 140-180 of them (a binomial
    bound beyond 5 sigma, so it cannot flake); each answer's `model` and header name the real
    model, and x-fleetgate-alias names the alias."""
    _, url = fleet
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda i: _chat(url, "chat"), range(200)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200][:3]
    assert all(r.json()["model"] == r.headers["x-fleetgate-model"] for r in replies)
    assert all(r.headers["x-fleetgate-alias"] == "chat" for r in replies)
    counts = Counter(r.headers["x-fleetgate-model"] for r in replies)
    print(f"alias chat 80/20 over 200 requests: {dict(counts)}")
    assert set(counts) == {"alpha", "beta"} and 140 <= counts["alpha"] <= 180


def test_a_session_keeps_its_model_and_an_adapter_can_be_a_target(fleet: tuple[Fleet, str]) -> None:
    """`canary` (alpha 50 / adapter tuned 50): one session always gets one model; across
    sessions both answer, the adapter under its own name."""
    _, url = fleet
    per_session = {s: {_chat(url, "canary", user=s).headers["x-fleetgate-model"] for _ in range(4)}
                   for s in (f"user-{i}" for i in range(16))}
    assert all(len(models) == 1 for models in per_session.values()), per_session
    assert set().union(*per_session.values()) == {"alpha", "tuned"}
    reply = _chat(url, "canary", user=next(s for s, m in per_session.items() if m == {"tuned"}))
    assert reply.json()["model"] == "tuned" and reply.headers["x-fleetgate-worker"] == "a"


def test_models_lists_aliases(fleet: tuple[Fleet, str]) -> None:
    """/v1/models has the served models and the aliases (with what they point to)."""
    _, url = fleet
    data = {m["id"]: m for m in openai.OpenAI(base_url=f"{url}/v1", api_key="x").models.list().model_dump()["data"]}
    assert {"alpha", "beta", "tuned", "small-ctx", "chat", "canary"} <= set(data)
    assert data["chat"]["fleetgate_alias_of"] == ["alpha", "beta"]
    assert httpx.get(f"{url}/v1/models/chat").json()["fleetgate_alias_of"] == ["alpha", "beta"]


def test_fallback_takes_over_when_the_primarys_workers_leave(fleet: tuple[Fleet, str]) -> None:
    """alpha's only worker stops: requests for alpha (whole and streamed) get beta's answer,
    not a 503, and the fallback is counted."""
    fleet_, url = fleet
    assert _chat(url, "alpha").headers["x-fleetgate-model"] == "alpha"
    fleet_.alpha.stop()  # type: ignore[attr-defined]
    wait_until(lambda: "alpha" not in {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}, timeout=30)
    reply = _chat(url, "alpha")
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "beta" and reply.headers["x-fleetgate-model"] == "beta"
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60,
                      json={"model": "alpha", "stream": True, "max_tokens": 2,
                            "messages": [{"role": "user", "content": "hi"}]}) as stream:
        assert stream.status_code == 200 and stream.headers["x-fleetgate-model"] == "beta"
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"beta"}
    metrics = httpx.get(f"{url}/metrics").text
    assert 'fleetgate_fallbacks_total{fallback="beta",model="alpha",reason="no_model"}' in metrics


def test_fallback_takes_a_prompt_too_long_for_the_model(fleet: tuple[Fleet, str]) -> None:
    """A 2,000-token prompt for small-ctx (256 tokens of context) is answered by beta; the
    same prompt for beta alone works, and a short one stays on small-ctx."""
    _, url = fleet
    long = "hello world " * 700
    reply = _chat(url, "small-ctx", long)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-fleetgate-model"] == "beta" and reply.json()["model"] == "beta"
    assert reply.json()["usage"]["prompt_tokens"] > 256
    assert _chat(url, "small-ctx").headers["x-fleetgate-model"] == "small-ctx"
    metrics = httpx.get(f"{url}/metrics").text
    assert 'fleetgate_fallbacks_total{fallback="beta",model="small-ctx",reason="context_length"}' in metrics


@pytest.fixture
def busy_fleet(fleet_factory: Callable[[], Fleet], tmp_path: Path) -> Iterator[str]:
    """alpha on one worker of batch 1 (full at one request: shed_queue_ratio 0), gamma on a
    worker whose engine fails every request; both fall back to beta."""
    fleet = fleet_factory()
    config = _config(tmp_path, fallbacks={"alpha": ["beta"], "gamma": ["beta"]}, shed_queue_ratio=0)
    _, url = fleet.gateway("--config", config)
    fleet.worker("a", "--model", "alpha", "--option", "time_scale=1.0", "--option", "max_num_seqs=1")
    fleet.worker("b", "--model", "beta", *FAST)
    fleet.worker("g", "--model", "gamma", *FAST, "--option", "faults=[error_rate=1.0]", "--no-warmup")
    fleet.wait_ready(url, "a", "b", "g")
    yield url


def test_fallback_takes_requests_while_every_worker_is_full(busy_fleet: str) -> None:
    """While a long stream fills alpha's only slot, requests for alpha are answered by beta at
    once (not queued, not 429); once it ends, alpha answers again."""
    url = busy_fleet
    body = {"model": "alpha", "stream": True, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "a long story"}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as stream:
        assert stream.headers["x-fleetgate-model"] == "alpha"
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # alpha is generating
        replies = [_chat(url, "alpha") for _ in range(3)]
        assert [r.headers["x-fleetgate-model"] for r in replies] == ["beta"] * 3, [r.text for r in replies]
        assert all(r.status_code == 200 and r.json()["model"] == "beta" for r in replies)
        stream.close()
    metrics = httpx.get(f"{url}/metrics").text
    assert 'fleetgate_fallbacks_total{fallback="beta",model="alpha",reason="no_capacity"} 3.0' in metrics
    wait_until(lambda: _chat(url, "alpha").headers["x-fleetgate-model"] == "alpha", timeout=30, interval=0.5)


def test_fallback_takes_requests_its_engines_fail(busy_fleet: str) -> None:
    """gamma's engine answers 500 to everything: after the retries (then with its circuit
    open) the request gets beta's answer instead of a 502/503."""
    url = busy_fleet
    for _ in range(5):
        reply = _chat(url, "gamma")
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-fleetgate-model"] == "beta" and "x-fleetgate-alias" not in reply.headers
