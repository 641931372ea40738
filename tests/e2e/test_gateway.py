"""The gateway end to end: real gateway and agent processes, simulated engines, real Redis.

Every request here crosses loopback: client -> gateway -> engine simulator.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.conftest import ADMIN_TOKEN, Fleet, children, wait_until

MODEL = "demo-model"
FAST = ("--model", MODEL, "--option", "time_scale=0.05")


@pytest.fixture(scope="module")
def shared_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    """Two simulated workers (different cards, one with an adapter) behind one gateway."""
    import uuid

    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("gw"))
    try:
        _, url = fleet.gateway()
        fleet.worker("big", *FAST, "--sim-profile", "h100-7b", "--max-model-len", "16384",
                     "--adapters", "fin=/adapters/fin")
        fleet.worker("small", *FAST, "--sim-profile", "t4-7b", "--max-model-len", "2048")
        fleet.wait_ready(url, "big", "small")
        yield fleet, url
    finally:
        fleet.close()


def chat(url: str, model: str = MODEL, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)


def test_models_lists_base_and_adapters_with_parent(shared_fleet: tuple[Fleet, str]) -> None:
    """/v1/models shows every base model and adapter of the ready fleet, OpenAI-style."""
    _, url = shared_fleet
    body = httpx.get(f"{url}/v1/models").json()
    assert body["object"] == "list"
    by_id = {m["id"]: m for m in body["data"]}
    assert by_id[MODEL]["parent"] is None
    assert by_id["fin"]["parent"] == MODEL
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    assert {m.id for m in client.models.list()} == {MODEL, "fin"}


def test_openai_client_chat_non_streaming_and_streaming(shared_fleet: tuple[Fleet, str]) -> None:
    """The official client gets real answers, whole and streamed, through the gateway."""
    _, url = shared_fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=12,
    )
    assert raw.headers["x-fleetgate-worker"] in ("big", "small")
    assert raw.headers["x-fleetgate-route"].startswith("fleet:")
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and 1 <= completion.usage.completion_tokens <= 12

    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    wait_until(lambda: all(w["load"]["inflight"] == 0 for w in shared_fleet[0].workers(url).values()), timeout=3)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and len(finishes) == 1
    assert chunks[-1].usage is not None


def test_content_parts_and_token_id_prompts_are_served(shared_fleet: tuple[Fleet, str]) -> None:
    """Messages whose content is a list of parts (as the openai client sends for multimodal
    input) and completions whose prompt is token ids reach an engine, not a 400."""
    _, url = shared_fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    completion = client.chat.completions.create(
        model=MODEL, max_tokens=6,
        messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                  {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}],
    )
    assert completion.choices[0].message.content
    for prompt in ([101, 102, 103, 104], [[101, 102, 103]]):
        text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)  # type: ignore[arg-type]
        assert text.choices[0].text


def test_several_choices_and_prompts_pass_through_whole_and_streamed(shared_fleet: tuple[Fleet, str]) -> None:
    """`n` > 1 and a list of prompts: every choice arrives, streamed ones interleaved by index,
    each with its own finish, and the stream ends once."""
    _, url = shared_fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    whole = client.completions.create(model=MODEL, prompt=["One", "Two"], n=2, max_tokens=4, temperature=0.8)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2, 3]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=5, temperature=0.8, stream=True,
        stream_options={"include_usage": True},
    ))
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == [0, 1, 2]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 3


def test_adapter_requests_go_only_to_the_worker_holding_it(shared_fleet: tuple[Fleet, str]) -> None:
    """A LoRA adapter name routes to the worker that has it loaded."""
    _, url = shared_fleet
    for _ in range(5):
        resp = chat(url, model="fin")
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-fleetgate-worker"] == "big"


def test_completions_endpoint_streams_chunk_by_chunk(shared_fleet: tuple[Fleet, str]) -> None:
    """/v1/completions streams SSE events that arrive over time, ending with [DONE]."""
    _, url = shared_fleet
    # 200 tokens, ~0.35 s of the fast simulator's decoding: the events' spread stays well above the
    # bound even when this client is descheduled a while (with 20, ~35 ms, a loaded CI machine
    # read them all in one go: 4.7 ms apart).
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "stream": True, "ignore_eos": True}
    arrivals: list[float] = []
    events: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    pieces = [json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]]
    assert len(pieces) == 200
    # Relayed as produced, not buffered: the events are spread over time.
    assert arrivals[-2] - arrivals[0] > 0.01, arrivals[-2] - arrivals[0]


def test_unknown_model_is_an_openai_404(shared_fleet: tuple[Fleet, str]) -> None:
    """A model no worker serves gets 404 in OpenAI's error shape, from the official client too."""
    _, url = shared_fleet
    resp = chat(url, model="no-such-model")
    assert resp.status_code == 404
    assert len(resp.headers["x-request-id"]) == 32  # errors carry the request id too
    err = resp.json()["error"]
    assert err["code"] == "model_not_found" and err["param"] == "model" and "no-such-model" in err["message"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": 5, "messages": []}', "model"),
        (b'{"model": "demo-model"}', "messages"),
        (b'{"model": "demo-model", "messages": []}', "messages"),
        (b'{"model": "demo-model", "messages": [{"role":"user","content":"x"}], "max_tokens": 0}', "max_tokens"),
        (b'[1, 2]', None),
    ],
)
def test_malformed_bodies_are_openai_400s(shared_fleet: tuple[Fleet, str], body: bytes, param: str | None) -> None:
    """Bad JSON or a bad body is a 400 with OpenAI's error shape, before any engine is called."""
    _, url = shared_fleet
    resp = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param


def test_engine_400_for_too_long_prompt_is_passed_through(shared_fleet: tuple[Fleet, str]) -> None:
    """An engine's own 4xx (prompt over max_model_len) reaches the client unchanged, not retried."""
    _, url = shared_fleet
    long_text = "word " * 20000
    body = {"model": "fin", "messages": [{"role": "user", "content": long_text}], "max_tokens": 4}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"]


def test_admin_needs_the_token(shared_fleet: tuple[Fleet, str]) -> None:
    """Admin endpoints answer 401 without the admin bearer token, with or without a wrong one."""
    _, url = shared_fleet
    assert httpx.get(f"{url}/admin/workers").status_code == 401
    resp = httpx.get(f"{url}/admin/workers", headers={"authorization": "Bearer wrong"})
    assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{url}/admin/workers/big/drain").status_code == 401


def test_admin_lists_workers_with_load(shared_fleet: tuple[Fleet, str]) -> None:
    """/admin/workers gives each worker's record, state and load."""
    fleet, url = shared_fleet
    workers = fleet.workers(url)
    big = workers["big"]
    assert big["engine"] == "sim" and big["model"] == MODEL and big["adapters"] == ["fin"]
    assert big["max_model_len"] == 16384 and big["state"] == "ready"
    assert set(big["load"]) >= {"running", "waiting", "kv_cache_usage", "inflight"}
    assert big["gpu"]["profile"] == "h100-7b"
    assert workers["small"]["max_model_len"] == 2048


def test_admin_on_unknown_worker_is_404(shared_fleet: tuple[Fleet, str]) -> None:
    """Draining or removing a worker that does not exist is a 404 OpenAI error."""
    fleet, url = shared_fleet
    with fleet.admin(url) as admin:
        resp = admin.post("/admin/workers/ghost/drain")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "worker_not_found"
        assert admin.delete("/admin/workers/ghost").status_code == 404


def test_unknown_route_is_an_openai_404(shared_fleet: tuple[Fleet, str]) -> None:
    """Even a path the gateway does not have answers in OpenAI's error shape."""
    _, url = shared_fleet
    resp = httpx.get(f"{url}/v1/nothing-here")
    assert resp.status_code == 404 and "error" in resp.json()


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/chat/completions"), ("DELETE", "/v1/models"),
                                              ("POST", "/health"), ("PUT", "/admin/workers")])
def test_a_method_a_route_lacks_is_an_openai_405_that_says_what_is_allowed(
    shared_fleet: tuple[Fleet, str], method: str, path: str,
) -> None:
    _, url = shared_fleet
    resp = httpx.request(method, f"{url}{path}")
    assert resp.status_code == 405, resp.text
    assert resp.json()["error"]["message"] == f"Method {method} is not allowed on {path}."
    allowed = {m.strip() for m in resp.headers["allow"].split(",")}
    assert method not in allowed and allowed & {"GET", "POST"}, allowed


# -- tests with a fleet of their own (they kill or drain workers) ---------------------------


def test_drain_under_load_sends_nothing_new_and_finishes_in_flight(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """Draining under load: in-flight requests on the drained worker complete; new ones go elsewhere."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--policy", "least_outstanding")  # spread the first wave over both
    fleet.worker("a", "--model", MODEL, "--option", "time_scale=0.2", "--option", "max_num_seqs=4")
    fleet.worker("b", "--model", MODEL, "--option", "time_scale=0.2", "--option", "max_num_seqs=4")
    fleet.wait_ready(url, "a", "b")
    long_body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 60,
                 "ignore_eos": True}

    def call() -> tuple[int, str]:
        resp = httpx.post(f"{url}/v1/chat/completions", json=long_body, timeout=60)
        return resp.status_code, resp.headers.get("x-fleetgate-worker", "")

    engines = {wid: str(w["url"]) for wid, w in fleet.workers(url).items()}

    def in_engines() -> dict[str, int]:
        return {wid: sum(int(httpx.get(f"{u}/sim/state", timeout=5).json()[k]) for k in ("running", "waiting"))
                for wid, u in engines.items()}

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        before = [pool.submit(call) for _ in range(8)]
        # The precondition: all eight in the engines, on both (each 60 tokens at this time scale:
        # seconds), before the drain.
        wait_until(lambda: sum(in_engines().values()) == 8, timeout=10)
        assert all(n > 0 for n in in_engines().values())
        with fleet.admin(url) as admin:
            assert admin.post("/admin/workers/a/drain").status_code == 200
        wait_until(lambda: fleet.workers(url)["a"]["state"] == "draining", timeout=5)
        after = [pool.submit(call) for _ in range(8)]
        results_before = [f.result() for f in before]
        results_after = [f.result() for f in after]
    assert all(status == 200 for status, _ in results_before + results_after)
    assert {w for _, w in results_before} == {"a", "b"}
    assert {w for _, w in results_after} == {"b"}
    assert fleet.workers(url)["a"]["state"] == "draining"
    with fleet.admin(url) as admin:
        assert admin.post("/admin/workers/a/undrain").status_code == 200
    wait_until(lambda: fleet.workers(url)["a"]["state"] == "ready", timeout=5)


def test_sigkilled_worker_vanishes_within_5s_and_requests_keep_succeeding(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """SIGKILL an agent and its engine: the worker leaves /admin/workers within 5 s, no request fails."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    victim = fleet.worker("victim", *FAST)
    fleet.worker("survivor", *FAST)
    fleet.wait_ready(url, "victim", "survivor")
    engine_pids = children(victim.pid)
    victim.kill_group(signal.SIGKILL)  # the agent and the engine it started, at once
    for pid in engine_pids:
        os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    statuses = []
    while "victim" in fleet.workers(url):
        statuses.append(chat(url).status_code)
        assert time.monotonic() - killed_at < 5.0, "dead worker still registered after 5 s"
    vanished_s = time.monotonic() - killed_at
    statuses += [chat(url).status_code for _ in range(5)]
    assert statuses and all(s == 200 for s in statuses), statuses
    print(f"dead worker vanished after {vanished_s:.2f} s")


def test_all_workers_drained_gives_503_with_retry_after(fleet_factory: Callable[[], Fleet]) -> None:
    """When every worker of a model is drained the client gets 503 + Retry-After, not a hang."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("only", *FAST)
    fleet.wait_ready(url, "only")
    with fleet.admin(url) as admin:
        admin.post("/admin/workers/only/drain")
    wait_until(lambda: chat(url).status_code == 503, timeout=3)
    resp = chat(url)
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "no_worker_available"


def test_engine_death_before_first_byte_is_retried_on_another_worker(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """An engine that errors (5xx) is retried elsewhere; the client sees only successes."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    # --no-warmup: a failing warm-up is a failed start; this engine must get as far as ready.
    fleet.worker("flaky", *FAST, "--option", "faults=[error_rate=1.0]", "--no-warmup")
    fleet.worker("solid", *FAST)
    fleet.wait_ready(url, "flaky", "solid")
    results = [chat(url) for _ in range(6)]
    assert [r.status_code for r in results] == [200] * 6
    assert {r.headers["x-fleetgate-worker"] for r in results} == {"solid"}


def test_client_disconnect_mid_stream_cancels_the_engine_request(fleet_factory: Callable[[], Fleet]) -> None:
    """A client that hangs up mid-stream makes the gateway close the engine's request."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("w", "--model", MODEL, "--option", "time_scale=1.0")
    fleet.wait_ready(url, "w")
    engine_url = fleet.workers(url)["w"]["url"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))

        def running() -> float:
            return _metric(engine_url, "vllm:num_requests_running")

        assert running() == 1
    # The with-block closed the connection after one event.
    wait_until(lambda: _metric(engine_url, "vllm:num_requests_running") == 0, timeout=5)


def _metric(engine_url: str, name: str) -> float:
    text = httpx.get(f"{engine_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_gateway_requires_api_key_when_configured(fleet_factory: Callable[[], Fleet]) -> None:
    """With FLEETGATE_API_KEYS set, /v1 needs one of the keys; the openai client's key works."""
    fleet = fleet_factory()
    _, url = fleet.gateway(env={"FLEETGATE_API_KEYS": "sk-test-one,sk-test-two"})
    fleet.worker("w", *FAST)
    fleet.wait_ready(url, "w")
    assert chat(url).status_code == 401
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-test-two")
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2
    ).choices
    assert ADMIN_TOKEN not in httpx.get(f"{url}/health").text


def test_replicas_share_in_flight_counts_through_redis(fleet_factory: Callable[[], Fleet]) -> None:
    """Requests in flight through one gateway count in every other gateway's view of the fleet."""
    fleet = fleet_factory()
    _, url1 = fleet.gateway()
    _, url2 = fleet.gateway()
    fleet.worker("w", "--model", MODEL, "--option", "time_scale=0.5")
    fleet.wait_ready(url1, "w")
    # Three streams held open: each is in flight from its first event until the test closes it,
    # however fast or slow this machine is (finished answers would race the replicas' sync).
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    held = []  # each stream's line iterator: one dropped would close its stream
    with httpx.Client(base_url=url1, timeout=60) as client, contextlib.ExitStack() as streams:
        for _ in range(3):
            resp = streams.enter_context(client.stream("POST", "/v1/completions", json=body))
            assert resp.status_code == 200
            held.append(lines := resp.iter_lines())
            assert next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: fleet.workers(url2)["w"]["load"]["inflight"] == 3, timeout=10)
    # Closed by their client: released here and in the other replica's view.
    wait_until(lambda: fleet.workers(url2)["w"]["load"]["inflight"] == 0, timeout=10)


def test_a_streams_prefill_counts_on_every_replica_until_its_first_token(fleet_factory: Callable[[], Fleet]) -> None:
    """`prefill_pending`: the prompt tokens a worker's engine has still to prefill for the streams
    sent to it, on every replica; a stream's first event ends its share, its end the rest."""
    fleet = fleet_factory()
    _, url1 = fleet.gateway("--set", "first_byte_timeout_s=60")
    _, url2 = fleet.gateway()
    fleet.worker("w", "--model", MODEL)  # at the card's speed: 2,000 tokens take ~40 s
    fleet.wait_ready(url1, "w")
    engine = str(fleet.workers(url1)["w"]["url"])

    def load(url: str) -> tuple[int, int]:
        w = fleet.workers(url)["w"]["load"]
        return int(w["prefill_pending"]), int(w["inflight"])

    body = {"model": MODEL, "prompt": "tell me a long story " * 50, "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=url1, timeout=60) as client, contextlib.ExitStack() as streams:
        # The engine sends a stream's headers, then nothing: its prefill never ends.
        assert httpx.post(f"{engine}/sim/faults", json={"stall_after_chunks": 0}).status_code == 200
        stalled = streams.enter_context(client.stream("POST", "/v1/completions", json=body))
        assert stalled.status_code == 200
        wait_until(lambda: load(url2)[0] > 0 and load(url2)[1] == 1, timeout=10)
        queued = load(url2)[0]
        assert load(url1) == (queued, 1)
        assert queued >= 200  # the prompt's ~250 tokens (an estimate: no tokenizer here)
        # A second stream, the fault cleared: its first event ends its prefill.
        assert httpx.post(f"{engine}/sim/faults", json={"stall_after_chunks": None}).status_code == 200
        served = streams.enter_context(client.stream("POST", "/v1/completions", json=body))
        lines = served.iter_lines()  # kept: a dropped iterator would close its stream
        assert next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: load(url2) == (queued, 2), timeout=10)
        assert load(url1) == (queued, 2)
    # Both closed by their client, the stalled one before its first event: nothing is left.
    wait_until(lambda: load(url1) == (0, 0) and load(url2) == (0, 0), timeout=10)


def test_keep_alive_connections_survive_many_concurrent_streams(shared_fleet: tuple[Fleet, str]) -> None:
    """Many streams over a small pool of keep-alive connections, then plain requests on the same
    connections: every request gets its answer (a finished stream must leave its connection usable)."""
    _, url = shared_fleet
    stream_body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "ignore_eos": True, "stream": True}
    plain_body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    with httpx.Client(base_url=url, timeout=10, limits=limits) as client:

        def one_stream(_: int) -> bool:
            with client.stream("POST", "/v1/completions", json=stream_body) as resp:
                return resp.read().endswith(b"data: [DONE]\n\n")

        def one_plain(_: int) -> int:
            return client.post("/v1/completions", json=plain_body).status_code

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in range(3):
                assert all(pool.map(one_stream, range(120)))
                assert list(pool.map(one_plain, range(40))) == [200] * 40
