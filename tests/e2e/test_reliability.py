"""Failures of workers and overload, end to end: retries, circuit breaking, mid-stream
failover, load shedding, oversized bodies. Real gateway, agents and simulated engines."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
from collections.abc import Callable

import httpx
import openai

from tests.conftest import Fleet, children, wait_until

MODEL = "rel-model"


def stream_text(url: str, body: dict[str, object]) -> tuple[str, list[dict[str, object]], list[str]]:
    """The text of a chat/completions stream, its parsed events, and the raw data lines."""
    events: list[dict[str, object]] = []
    raw: list[str] = []
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                raw.append(line[6:])
                if line[6:] != "[DONE]":
                    events.append(json.loads(line[6:]))
    text = ""
    for e in events:
        for c in e.get("choices", []):  # type: ignore[union-attr]
            text += (c.get("delta", {}).get("content") or "") if "delta" in c else (c.get("text") or "")
    return text, events, raw


def test_chat_stream_continues_on_another_worker_when_its_engine_dies(fleet_factory: Callable[[], Fleet]) -> None:
    """SIGKILL the engine serving a stream: the client still gets one stream, same id, one finish."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "stall_timeout_s=2")
    agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.3") for wid in ("a", "b", "c")}
    fleet.wait_ready(url, "a", "b", "c")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 60,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events: list[dict[str, object]] = []
    raw: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        victim = resp.headers["x-fleetgate-worker"]
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            raw.append(line[6:])
            if line[6:] != "[DONE]":
                events.append(json.loads(line[6:]))
            if len(raw) == 10:
                for pid in children(agents[victim].pid):
                    os.kill(pid, signal.SIGKILL)
    ids = {e["id"] for e in events}
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]  # type: ignore[union-attr]
    roles = [c for e in events for c in e["choices"] if c.get("delta", {}).get("role")]  # type: ignore[union-attr]
    text = "".join(c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])  # type: ignore[union-attr]
    assert len(ids) == 1 and finishes == ["length"] and len(roles) == 1
    assert raw[-1] == "[DONE]" and not any("error" in e for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 60  # type: ignore[index]
    assert len(text) > 20
    wait_until(lambda: victim not in fleet.workers(url), timeout=10)


def test_completion_stream_resumes_after_a_stall(fleet_factory: Callable[[], Fleet]) -> None:
    """A stream that stops sending (stalled engine) is continued elsewhere after the stall timeout."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "stall_timeout_s=0.5", "--policy", "round_robin")
    fleet.worker("a", "--model", MODEL, "--option", "time_scale=0.1", "--option", "faults=[stall_after_chunks=5]")
    fleet.worker("b", "--model", MODEL, "--option", "time_scale=0.1")
    fleet.wait_ready(url, "a", "b")
    for _ in range(2):  # round-robin: one of these starts on the stalling worker
        text, events, raw = stream_text(url, {"model": MODEL, "prompt": "Once", "max_tokens": 30, "ignore_eos": True})
        pieces = [c["text"] for e in events for c in e["choices"]]  # type: ignore[union-attr]
        assert len([p for p in pieces if p]) == 30 and raw[-1] == "[DONE]"
        assert text == "".join(pieces)
        assert len({e["id"] for e in events}) == 1


def test_unresumable_stream_ends_with_an_error_event_not_a_hang(fleet_factory: Callable[[], Fleet]) -> None:
    """n>1 cannot be resumed faithfully: a dying engine ends the stream with an error event and [DONE]."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "stall_timeout_s=1")
    fleet.worker("a", "--model", MODEL, "--option", "time_scale=0.1", "--option", "faults=[stall_after_chunks=3]")
    fleet.wait_ready(url, "a")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True, "logprobs": 1}
    _, events, raw = stream_text(url, body)
    assert raw[-1] == "[DONE]"
    assert events[-1]["error"]["code"] == "stream_interrupted"  # type: ignore[index]


def test_failing_worker_opens_its_circuit_on_every_gateway_and_recovers(fleet_factory: Callable[[], Fleet]) -> None:
    """Repeated 5xx open the worker's circuit (seen by another gateway); when it heals, the probe closes it."""
    fleet = fleet_factory()
    _, url1 = fleet.gateway("--set", "breaker_cooldown_s=1", "--policy", "round_robin")
    _, url2 = fleet.gateway()
    # --no-warmup: a failing warm-up is a failed start; this engine must get as far as ready.
    fleet.worker("bad", "--model", MODEL, "--option", "time_scale=0.05", "--option", "faults=[error_rate=1.0]",
                 "--no-warmup")
    fleet.worker("good", "--model", MODEL, "--option", "time_scale=0.05")
    fleet.wait_ready(url1, "bad", "good")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    statuses = [httpx.post(f"{url1}/v1/completions", json=body).status_code for _ in range(8)]
    assert statuses == [200] * 8  # every failure was retried on the good worker
    circuit = wait_until(lambda: fleet.workers(url2)["bad"]["circuit"]["state"] == "open", timeout=5)
    assert circuit
    assert "failures in a row" in fleet.workers(url2)["bad"]["circuit"]["reason"]
    bad_url = fleet.workers(url1)["bad"]["url"]
    httpx.post(f"{bad_url}/sim/faults", json={"error_rate": None})
    wait_until(lambda: fleet.workers(url2)["bad"]["circuit"]["state"] == "closed", timeout=10)


def test_full_fleet_queues_then_sheds_with_429_and_retry_after(fleet_factory: Callable[[], Fleet]) -> None:
    """With every worker full, requests wait briefly in the gateway's queue, then get 429 + Retry-After."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "shed_queue_ratio=0", "--set", "queue_timeout_s=0.5", "--set", "queue_max=2")
    fleet.worker("a", "--model", MODEL, "--option", "time_scale=1.0", "--option", "max_num_seqs=1")
    fleet.wait_ready(url, "a")
    body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=60), range(6)))
    ok = [r for r in results if r.status_code == 200]
    shed = [r for r in results if r.status_code == 429]
    assert ok and shed and len(ok) + len(shed) == 6
    assert all(r.headers["retry-after"].isdigit() for r in shed)
    assert {r.json()["error"]["type"] for r in shed} == {"rate_limit_error"}
    # Capacity comes back once the engine reports its batch empty (a second or two later);
    # the official client's own retries honour Retry-After until then.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=5)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices


def test_body_over_the_limit_is_a_413_openai_error(fleet_factory: Callable[[], Fleet]) -> None:
    """A body larger than max_body_bytes is refused with 413 in OpenAI's shape, before routing."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "max_body_bytes=1000")
    resp = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})
    assert resp.status_code == 413
    assert resp.json()["error"]["type"] == "invalid_request_error"
