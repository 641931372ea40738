"""What operators see and what engines are spared: bounded metric labels, a log line and a count
for every refusal, request ids forwarded to engines, tokens of every stream counted, and an
engine's work stopped when the client hangs up. Real gateway, agents and simulated engines."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Fleet, children, wait_until

MODEL = "obs-model"
EMBED = "obs-embed"
KEY = "sk-obs-0123456789"
LIMITED = "sk-obs-limited-42"  # the key test 1 runs out of its rate limit with
FAST = ("--option", "time_scale=0.05")


def total(url: str, name: str, **want: str) -> float:
    """The sum of a metric's samples whose labels include `want`, from a scrape of /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and set(want.items()) <= set(s.labels.items()))


def model_labels(url: str) -> set[str]:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {s.labels["model"] for family in text_string_to_metric_families(text) for s in family.samples
            if "model" in s.labels and s.name.startswith(("fleetgate_requests", "fleetgate_request_duration"))}


def request_lines(fleet: Fleet, gateway_index: int = 0) -> list[dict[str, Any]]:
    """The gateway's `gateway.request` events (its log is JSON: not a terminal)."""
    out = []
    for line in fleet.procs[gateway_index].output().splitlines():
        if '"gateway.request"' in line:
            out.append(json.loads(line))
    return out


@pytest.fixture(scope="module")
def keyed(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    """A gateway with an API key and a rate limit, a generative and an embedding worker."""
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("obs"))
    try:
        _, url = fleet.gateway("--set", "rate_limit_rpm=6", "--set", "rate_limit_burst=12",
                               env={"FLEETGATE_API_KEYS": f"{KEY},{LIMITED}"})
        fleet.worker("gen", "--model", MODEL, *FAST)
        fleet.worker("embed", "--model", EMBED, *FAST, "--option", "runner=pooling", "--option", "convert=embed")
        fleet.wait_ready(url, "gen", "embed")
        yield fleet, url
    finally:
        fleet.close()


def test_refusals_are_logged_and_counted_and_random_models_make_no_series(keyed: tuple[Fleet, str]) -> None:
    """401, 400, 404 and the client's 429 each get a gateway.request line with status and code and
    are counted; three made-up model names add no label value (they count as `unknown`)."""
    fleet, url = keyed
    auth = {"authorization": f"Bearer {LIMITED}"}
    chat = f"{url}/v1/chat/completions"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(chat, json=body, headers=auth).status_code == 200
    for name in ("rnd-a1", "rnd-b2", "rnd-c3"):
        assert httpx.post(chat, json={**body, "model": name}, headers=auth).status_code == 404
    assert httpx.post(chat, content=b"{not json", headers=auth).status_code == 400
    assert httpx.post(chat, json=body, headers={"authorization": "Bearer sk-wrong"}).status_code == 401
    statuses = [httpx.post(chat, json=body, headers=auth).status_code for _ in range(12)]
    assert 429 in statuses
    labels = model_labels(url)
    assert MODEL in labels and "unknown" in labels and not labels & {"rnd-a1", "rnd-b2", "rnd-c3"}
    assert total(url, "fleetgate_requests_total", model="unknown", status="404") == 3
    for status, code in (("401", "invalid_api_key"), ("400", "invalid_request"), ("404", "model_not_found"),
                         ("429", "rate_limit_exceeded")):
        assert total(url, "fleetgate_errors_total", status=status, code=code) >= 1, (status, code)
    lines = request_lines(fleet)
    seen = {(line["status"], line.get("error")) for line in lines}
    assert {(401, "invalid_api_key"), (400, "invalid_request"), (404, "model_not_found"),
            (429, "rate_limit_exceeded")} <= seen
    assert all(line.get("request_id") for line in lines)


def test_request_id_reaches_the_engine(keyed: tuple[Fleet, str]) -> None:
    """The client's x-request-id (else the gateway's own) is sent to the engine, which names its
    response by it (vLLM's and the simulator's embeddings id is `embd-<x-request-id>`)."""
    _, url = keyed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    raw = client.embeddings.with_raw_response.create(model=EMBED, input="trace me",
                                                     extra_headers={"x-request-id": "trace-4711"})
    assert raw.headers["x-request-id"] == "trace-4711"
    assert raw.http_response.json()["id"] == "embd-trace-4711"
    raw = client.embeddings.with_raw_response.create(model=EMBED, input="trace me")
    assert raw.http_response.json()["id"] == f"embd-{raw.headers['x-request-id']}"


def test_stream_tokens_are_counted_without_include_usage_and_the_chunk_stays_hidden(
    keyed: tuple[Fleet, str],
) -> None:
    """A stream whose client did not ask for usage is still counted (the gateway asks the engine)
    and the client never sees the `choices: []` usage chunk; one that asked gets it."""
    _, url = keyed
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=3)
    before = total(url, "fleetgate_tokens_total", model=MODEL, kind="completion")
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=9, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks and all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    with httpx.stream("POST", f"{url}/v1/completions", headers={"authorization": f"Bearer {KEY}"}, json={
            "model": MODEL, "prompt": "count", "max_tokens": 5, "ignore_eos": True, "stream": True}) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"usage"' in e for e in events)
    assert total(url, "fleetgate_tokens_total", model=MODEL, kind="completion") - before == 14
    asked = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert asked[-1].choices == [] and asked[-1].usage is not None and asked[-1].usage.completion_tokens == 4
    assert total(url, "fleetgate_tokens_total", model=MODEL, kind="completion") - before == 18


def test_resumed_stream_without_include_usage_is_counted_whole(fleet_factory: Callable[[], Fleet]) -> None:
    """The engine dies mid-stream: the continuation also reports usage, the client sees none, and
    the gateway counts every token of both engines."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "stall_timeout_s=2")
    agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.3") for wid in ("a", "b")}
    fleet.wait_ready(url, "a", "b")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 40,
            "ignore_eos": True, "stream": True}
    raw: list[str] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        victim = resp.headers["x-fleetgate-worker"]
        for line in resp.iter_lines():
            if line.startswith("data: "):
                raw.append(line[6:])
                if len(raw) == 8:
                    for pid in children(agents[victim].pid):
                        os.kill(pid, signal.SIGKILL)
    assert raw[-1] == "[DONE]" and not any('"usage"' in r for r in raw)
    pieces = [c for r in raw[:-1] for c in json.loads(r)["choices"] if c["delta"].get("content")]
    assert len(pieces) == 40
    line = wait_until(lambda: [x for x in request_lines(fleet) if x.get("resumes")], timeout=5)
    assert line[0]["completion_tokens"] == 40  # type: ignore[index]
    assert total(url, "fleetgate_tokens_total", model=MODEL, kind="completion") == 40


def _running(engine_url: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=5).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "vllm:num_requests_running")


@pytest.mark.parametrize("fast_path", ["true", "false"])
def test_client_hanging_up_on_a_whole_answer_stops_the_engine(
    fleet_factory: Callable[[], Fleet], fast_path: str,
) -> None:
    """A non-streaming client that gives up after a second: the engine stops generating within
    seconds (not after its 2,000 tokens), the in-flight count returns to 0, the log says client_gone."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", f"fast_path={fast_path}")
    fleet.worker("w", "--model", MODEL, "--option", "time_scale=1.0")
    fleet.wait_ready(url, "w")
    engine = fleet.workers(url)["w"]["url"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 2000,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    wait_until(lambda: _running(engine) == 0, timeout=3)
    wait_until(lambda: fleet.workers(url)["w"]["load"]["inflight"] == 0, timeout=3)
    gone = wait_until(lambda: [x for x in request_lines(fleet) if x.get("outcome") == "client_gone"], timeout=3)
    assert gone[0]["status"] == 499  # type: ignore[index]
    assert httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=30).status_code == 200
