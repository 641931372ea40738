"""Engines that answer garbage: a tiny hostile engine in the test (it is the engine that misbehaves,
not the thing under test), registered as a worker, answers 200 with invalid JSON, a stream event
that does not parse, an error after the first chunk, a clean end without `[DONE]`, or the wrong
content type. Each request ends as a whole stream (resumed on a real simulated engine) or a clear
OpenAI-style error: never a hang, a traceback or the engine's address in the client's body.
Real Redis, gateway, agent and simulator."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerInfo
from tests.conftest import Fleet
from tests.e2e.faults import ADDRESS, Counts, wait_for

MODEL = "fault-garbage-model"
TOKENS = 12
# Each way the hostile engine answers; the client's request names it in its prompt.
WHOLE = ("bad-json", "wrong-type", "error-500")
STREAMED = ("bad-event", "error-after-first", "end-without-done", "wrong-type")
# A Responses API stream's ways (not resumed elsewhere: each must end with the gateway's error event).
RESPONSES = ("bad-event", "error-event", "html-event")


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the gateway hangs up on a garbled stream: expected, not worth a traceback


class HostileEngine:
    """Answers /health; every completion request as its prompt's mode says. Its error messages
    name its own address, as real engines' do: none of it may reach a client."""

    def __init__(self) -> None:
        self.served: list[str] = []
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._send(200, "application/json", b"{}")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                if self.path == "/v1/responses":
                    self._responses(str(body.get("input", "")).split()[0])
                    return
                mode = body["messages"][-1]["content"].split()[0] if body.get("messages") else ""
                engine.served.append(mode)
                if not body.get("stream"):
                    if mode == "bad-json":
                        self._send(200, "application/json", b'{"id": "x", "choices": [{"message": ')
                    elif mode == "error-500":
                        self._send(500, "application/json", json.dumps({"error": {
                            "message": f"engine at {engine.url} crashed: CUDA error", "type": "InternalServerError",
                            "param": None, "code": 500}}).encode())
                    else:
                        self._send(200, "text/html", f"<html>OK from {engine.url}</html>".encode())
                    return
                if mode == "wrong-type":
                    self._send(200, "text/html", f"<html>502 Bad Gateway at {engine.url}</html>".encode())
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                self._event(self._chunk(body, {"role": "assistant", "content": ""}))
                self._event(self._chunk(body, {"content": "Gar"}))
                if mode == "bad-event":
                    self._write(b'data: {"id": "s1", "choices": [{"delta": \n\n')
                    self._event(self._chunk(body, {"content": "bage"}))
                    self._write(b"data: [DONE]\n\n")
                elif mode == "error-after-first":
                    self._event({"error": {"object": "error", "type": "InternalServerError", "code": 500,
                                           "message": f"engine at {engine.url} crashed: CUDA error"}})
                    self._write(b"data: [DONE]\n\n")
                self._write(b"")  # the last chunk: a clean end, without [DONE] where none came

            def _responses(self, mode: str) -> None:
                """A Responses API stream that turns to garbage after its first text."""
                engine.served.append(f"responses {mode}")
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                response = {"id": "resp_hostile", "object": "response", "status": "in_progress", "model": MODEL}
                self._write(b"event: response.created\ndata: " + json.dumps(
                    {"type": "response.created", "response": response, "sequence_number": 0}).encode() + b"\n\n")
                self._write(b"event: response.output_text.delta\ndata: " + json.dumps(
                    {"type": "response.output_text.delta", "delta": "Gar", "sequence_number": 1}).encode() + b"\n\n")
                if mode == "bad-event":
                    self._write(b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
                                b'"delta": \n\n')
                elif mode == "error-event":
                    self._write(b"event: error\ndata: " + json.dumps(
                        {"type": "error", "code": "server_error", "param": None, "sequence_number": 2,
                         "message": f"engine at {engine.url} crashed: CUDA error"}).encode() + b"\n\n")
                else:
                    self._write(f"event: response.output_text.delta\ndata: <html>502 at {engine.url}</html>\n\n"
                                .encode())
                self._write(b"")

            def _chunk(self, body: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
                return {"id": "s1", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                        "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

            def _event(self, payload: dict[str, Any]) -> None:
                self._write(b"data: " + json.dumps(payload).encode() + b"\n\n")

            def _write(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _send(self, status: int, content_type: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def hostile() -> Iterator[HostileEngine]:
    engine = HostileEngine()
    yield engine
    engine.server.shutdown()


def _register(fleet: Fleet, engine: HostileEngine) -> None:
    async def go() -> None:
        redis = connect(fleet.redis_url)
        registry = Registry(redis, fleet.prefix, heartbeat_ttl_s=300)
        await registry.register(WorkerInfo(id="hostile", url=engine.url, engine="vllm", model=MODEL), "ready")
        await redis.aclose()

    asyncio.run(go())


def _clean(text: str) -> str:
    """What must never reach a client: an address, a traceback."""
    return "" if not ADDRESS.search(text) and "Traceback" not in text else text


def _json(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return None


def _error(resp: httpx.Response) -> bool:
    """Whether `resp` is a clear OpenAI-style error: a JSON body of one error object."""
    body = _json(resp)
    return resp.status_code >= 400 and resp.headers.get("content-type", "").startswith("application/json") \
        and isinstance(body, dict) and set(body.get("error") or {}) == {"message", "type", "param", "code"}


def _whole(client: httpx.Client, mode: str, counts: Counts) -> None:
    body = {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{mode} whole"}]}
    try:
        resp = client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        counts.add("lost", f"{mode} whole: {exc!r}")
        return
    if leak := _clean(resp.text):
        counts.add("lost", f"{mode} whole leaked: {leak[:300]}")
    elif resp.status_code == 200 and (_json(resp) or {}).get("usage", {}).get("completion_tokens") == TOKENS:
        counts.add("ok")
    elif _error(resp):
        counts.add("failed")
    else:
        counts.add("lost", f"{mode} whole: {resp.status_code} {resp.text[:300]}")


def _stream(client: httpx.Client, mode: str, counts: Counts) -> str:
    """One streamed request; the worker it started on."""
    body = {"model": MODEL, "max_tokens": TOKENS, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": f"{mode} streamed"}]}
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            resp.read()
    except httpx.HTTPError as exc:
        counts.add("lost", f"{mode} stream: {exc!r}")
        return ""
    worker = resp.headers.get("x-fleetgate-worker", "")
    if leak := _clean(resp.text):
        counts.add("lost", f"{mode} stream leaked: {leak[:300]}")
        return worker
    if resp.status_code != 200 or not resp.headers.get("content-type", "").startswith("text/event-stream"):
        outcome = "failed" if _error(resp) else "lost"
        counts.add(outcome, "" if outcome == "failed" else f"{mode} stream: {resp.status_code} {resp.text[:300]}")
        return worker
    data = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    try:
        events = [json.loads(d) for d in data if d != "[DONE]"]
    except ValueError:
        counts.add("lost", f"{mode} stream: an event that does not parse reached the client: {resp.text[:400]}")
        return worker
    errors = [e["error"] for e in events if "error" in e]
    pieces = sum(bool(c["delta"].get("content")) for e in events for c in e.get("choices", []))
    finishes = sum(bool(c.get("finish_reason")) for e in events for c in e.get("choices", []))
    if not data or data[-1] != "[DONE]":
        counts.add("lost", f"{mode} stream: no [DONE]: {resp.text[-300:]}")
    elif errors:
        clear = len(errors) == 1 and set(errors[0]) >= {"message", "type", "code"} and "error" in events[-1]
        counts.add("failed" if clear else "lost", "" if clear else f"{mode} stream: {errors}")
    elif finishes == 1 and len({e["id"] for e in events}) == 1 and pieces >= 2:
        counts.add("ok")
    else:
        counts.add("lost", f"{mode} stream: pieces={pieces} finishes={finishes}: {resp.text[-300:]}")
    return worker


def test_engines_that_answer_garbage_end_in_whole_streams_or_clear_errors(
    fleet_factory: Callable[[], Fleet], hostile: HostileEngine,
) -> None:
    """Alone, the hostile engine's every answer ends as a clear OpenAI error (a JSON error, or a
    stream's error event then [DONE]) within the timeout; beside a real simulated engine, its
    broken streams are resumed there whole (one id, one finish, [DONE]) or end as clear errors.
    No client body holds an address or a traceback."""
    fleet = fleet_factory()
    # Its circuit never opens here: every request must reach the hostile engine first.
    gateway, url = fleet.gateway("--policy", "round_robin", "--set", "breaker_threshold=1000",
                                 "--set", "stall_timeout_s=3", "--set", "first_byte_timeout_s=5")
    _register(fleet, hostile)
    counts = Counts()
    with httpx.Client(base_url=url, timeout=30) as client:
        wait_for(lambda: MODEL in {m["id"] for m in client.get("/v1/models").json()["data"]}, timeout=10)
        for mode in WHOLE:
            _whole(client, mode, counts)
        for mode in STREAMED:
            _stream(client, mode, counts)
        alone = len(WHOLE) + len(STREAMED)
        assert counts.lost == 0 and counts.failed == alone, counts.why
        assert sorted(set(hostile.served)) == sorted({*WHOLE, *STREAMED})  # each reached the engine

        fleet.worker("sim", "--model", MODEL, "--option", "time_scale=0.05")
        fleet.wait_ready(url, "sim")
        started_hostile = {mode: 0 for mode in STREAMED}
        # Round robin: about every other request starts on the hostile engine.
        for _ in range(40):
            if min(started_hostile.values()) >= 2:
                break
            for mode in STREAMED:
                ok = counts.ok
                if _stream(client, mode, counts) == "hostile":
                    started_hostile[mode] += 1
                    # Begun on the hostile engine, continued on the simulator: one whole stream.
                    assert counts.ok == ok + 1, (mode, counts.why)
            _whole(client, "bad-json", counts)
    counts.report("garbage-engine")
    assert min(started_hostile.values()) >= 2, started_hostile
    assert counts.lost == 0, counts.why
    out = gateway.output()
    assert "Traceback" not in out and "gateway.internal_error" not in out


def test_responses_streams_that_turn_to_garbage_end_with_the_gateways_error_event(
    fleet_factory: Callable[[], Fleet], hostile: HostileEngine,
) -> None:
    """A Responses API stream whose engine sends an event that does not parse, HTML, or its own
    error event (naming its address) after the first text: the client gets the text before it,
    then the gateway's `error` event, and nothing of the garbage or the engine's message. (A
    Responses stream is not resumed elsewhere: its state is on its engine.)"""
    fleet = fleet_factory()
    gateway, url = fleet.gateway("--set", "breaker_threshold=1000", "--set", "stall_timeout_s=3")
    _register(fleet, hostile)
    counts = Counts()
    with httpx.Client(base_url=url, timeout=30) as client:
        wait_for(lambda: MODEL in {m["id"] for m in client.get("/v1/models").json()["data"]}, timeout=10)
        for mode in RESPONSES:
            with client.stream("POST", "/v1/responses", json={"model": MODEL, "input": f"{mode} please",
                                                              "stream": True}) as resp:
                resp.read()
            events = [block.split("\n") for block in resp.text.strip().split("\n\n")]
            names = [lines[0].removeprefix("event: ") for lines in events]
            data = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
            clean = resp.status_code == 200 and not _clean(resp.text)
            if clean and names == ["response.created", "response.output_text.delta", "error"] \
                    and data[-1]["code"] == "stream_interrupted":
                counts.add("failed")  # a clear error, as it should be
            else:
                counts.add("lost", f"responses {mode}: {resp.status_code} {resp.text[-400:]}")
    counts.report("garbage-engine-responses")
    assert counts.lost == 0 and counts.failed == len(RESPONSES), counts.why
    assert sorted(hostile.served) == sorted(f"responses {mode}" for mode in RESPONSES)
    out = gateway.output()
    assert "Traceback" not in out and "gateway.internal_error" not in out
