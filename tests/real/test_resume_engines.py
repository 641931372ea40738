"""Resuming a stream on an engine of another kind, and streams that must not be resumed.

Real gateway, agents and simulated engines of both flavours (vLLM's and LMDeploy's), SIGKILL
mid-stream as in test_reliability.py. A recording proxy in front of the engine that takes
over shows the continuation it received."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from aiohttp import ClientSession, web

from fleetgate.net import free_port
from tests.conftest import Fleet, Proc, wait_until

MODEL = "resume-model"


def engine(fleet: Fleet, name: str, flavor: str, *extra: str) -> tuple[Proc, str]:
    """A simulator process of `flavor`, started by the test (attached to an agent as external)."""
    port = free_port()
    proc = Proc([sys.executable, "-m", "workers.simulator", "--port", str(port), "--served-model-name", MODEL,
                 "--flavor", flavor, *extra], fleet.tmp / f"{name}-engine.log")
    fleet.procs.append(proc)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout=20)
    return proc, url


class Recorder:
    """A reverse proxy in a thread of its own: forwards everything, keeps every JSON body POSTed."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.bodies: list[dict[str, Any]] = []
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self._ready.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        self._session = ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        data = await request.read()
        if request.method == "POST" and data:
            self.bodies.append(json.loads(data))
        async with self._session.request(request.method, self.target + request.path_qs, data=data,
                                         headers={"content-type": "application/json"}) as up:
            resp = web.StreamResponse(status=up.status)
            resp.content_type = up.content_type
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp


def read_stream(resp: httpx.Response, on_event: Callable[[int], None]) -> tuple[str, list[dict[str, Any]], list[str]]:
    raw: list[str] = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            raw.append(line[6:])
            on_event(len(raw))
    events = [json.loads(r) for r in raw if r != "[DONE]"]
    text = "".join(c.get("delta", {}).get("content") or "" for e in events for c in e.get("choices", []))
    return text, events, raw


@pytest.mark.parametrize(("first", "then"), [("lmdeploy", "vllm"), ("vllm", "lmdeploy")])
def test_continuation_is_shaped_for_the_engine_that_takes_over(
    fleet_factory: Callable[[], Fleet], first: str, then: str,
) -> None:
    """The continuation carries vLLM's continue_final_message only when a vLLM-like engine takes
    over, whichever engine broke; the client sees one whole stream."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "stall_timeout_s=2")
    victim, first_url = engine(fleet, "a", first, "--time-scale", "1.0")
    _, then_url = engine(fleet, "b", then, "--time-scale", "0.2")
    recorder = Recorder(then_url)
    fleet.worker("a", "--url", first_url, "--flavor", first, "--model", MODEL, engine="external")
    fleet.worker("b", "--url", recorder.url, "--flavor", then, "--model", MODEL, engine="external")
    fleet.wait_ready(url, "a", "b")
    admin = fleet.admin(url)
    assert admin.post("/admin/workers/b/drain").status_code == 200  # the stream starts on a
    time.sleep(0.3)

    def on_event(n: int) -> None:
        if n == 3:
            assert admin.post("/admin/workers/b/undrain").status_code == 200
            time.sleep(0.5)
            victim.send(signal.SIGKILL)

    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.headers["x-fleetgate-worker"] == "a"
        text, events, raw = read_stream(resp, on_event)
    admin.close()
    assert raw[-1] == "[DONE]" and not any("error" in e for e in events)
    assert len({e["id"] for e in events}) == 1
    continued = [b for b in recorder.bodies if b.get("stream") and b["messages"][-1]["role"] == "assistant"]
    assert len(continued) == 1
    sent = continued[0]["messages"][-1]["content"]
    assert sent and text.startswith(sent) and len(text) > len(sent)
    if then == "vllm":
        assert continued[0]["continue_final_message"] is True and continued[0]["add_generation_prompt"] is False
    else:
        assert "continue_final_message" not in continued[0] and "add_generation_prompt" not in continued[0]


CONSTRAINTS: dict[str, dict[str, Any]] = {
    "response_format": {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}},
    "guided decoding": {"guided_regex": "[a-z ]+"},
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
}


@pytest.fixture
def stalling_pair(fleet_factory: Callable[[], Fleet]) -> Iterator[tuple[str, str]]:
    """A gateway (round robin) over two simulated workers; `a`'s faults are set per case."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "stall_timeout_s=0.5", "--set", "breaker_threshold=100", "--policy", "round_robin")
    fleet.worker("a", "--model", MODEL, "--option", "time_scale=0.05")
    fleet.worker("b", "--model", MODEL, "--option", "time_scale=0.05")
    fleet.wait_ready(url, "a", "b")
    yield url, str(fleet.workers(url)["a"]["url"])


def test_constrained_stream_resumes_before_its_text_and_not_after(stalling_pair: tuple[str, str]) -> None:
    """A stream with response_format, guided decoding or tools whose engine stalls after its role
    chunk is resumed (nothing to restart); one that stalls after some text ends with an error event
    that says why (another engine would start the constraint over), then [DONE]."""
    url, a_url = stalling_pair
    for name, extra in CONSTRAINTS.items():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "json"}], "max_tokens": 20,
                "ignore_eos": True, "stream": True, **extra}
        for stall_after, resumed in ((1, True), (5, False)):
            httpx.post(f"{a_url}/sim/faults", json={"stall_after_chunks": stall_after})
            outcomes = []
            for _ in range(2):  # round robin: one of them starts on the stalling worker
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as resp:
                    on_a = resp.headers["x-fleetgate-worker"] == "a"
                    _, events, raw = read_stream(resp, lambda n: None)
                assert raw[-1] == "[DONE]"
                errors = [e["error"] for e in events if "error" in e]
                outcomes.append((on_a, errors))
                if not on_a or resumed:
                    assert not errors, (name, stall_after, errors)
                    assert len([c for e in events for c in e["choices"] if c["delta"].get("content")]) == 20
                else:
                    assert errors and errors[0]["code"] == "stream_interrupted", (name, events)
                    assert name.split()[0] in errors[0]["message"], errors[0]["message"]
            assert [on_a for on_a, _ in outcomes].count(True) == 1


def test_continuation_reads_a_clients_trailing_assistant_message_as_the_first_engine_did() -> None:
    """The client's own trailing assistant message: an engine that continued it gets the text
    appended to it; one that answered after it (vLLM without the flag) gets a new message."""
    from gateway.request.resume import continuation

    body = json.dumps({"model": MODEL, "max_tokens": 10, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "Sure: "}]}).encode()
    plan = continuation(body, "chat", "one two", 2, first_continues=True)
    assert plan is not None
    d = json.loads(plan.body(False))
    assert d["messages"][-1] == {"role": "assistant", "content": "Sure: one two"} and d["max_tokens"] == 8
    assert d["continue_final_message"] is True and d["add_generation_prompt"] is False
    plan = continuation(body, "chat", "one two", 2, first_continues=False)
    assert plan is not None
    d = json.loads(plan.body(True))
    assert d["messages"][-2:] == [{"role": "assistant", "content": "Sure: "}, {"role": "assistant", "content": "one two"}]
    assert "continue_final_message" not in d
    assert continuation(body, "chat", "all ten tokens", 10, first_continues=True) is None
