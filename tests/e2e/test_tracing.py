"""Tracing across hops: a real gateway process exports its spans over OTLP/HTTP to a real receiver
in the test (which decodes the protobuf export), routes to real HTTP stub engines that record the
trace headers they get, and is called with the official openai client carrying a traceparent."""

from __future__ import annotations

import asyncio
import gzip
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerInfo
from tests.conftest import Fleet, Proc, wait_until

OK, RETRY, RESUME = "trace-ok", "trace-retry", "trace-resume"


# -- a real OTLP/HTTP receiver -----------------------------------------------------------


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attrs: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    status: int
    service: str


@dataclass
class Receiver:
    """POST /v1/traces: an OTLP/HTTP collector's traces endpoint, decoding each export."""

    spans: list[Span] = field(default_factory=list)
    exports: int = 0
    url: str = ""

    def accept(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        self.exports += 1
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    self.spans.append(Span(
                        s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(), s.name, s.kind,
                        {a.key: _value(a.value) for a in s.attributes},
                        [(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                        s.status.code, str(resource.get("service.name")),
                    ))

    def trace(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.headers.get("content-encoding") == "gzip":
                body = gzip.decompress(body)
            status = 404
            if self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf":
                rec.accept(body)
                status = 200
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(status)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    rec.url = f"http://127.0.0.1:{server.server_address[1]}/v1/traces"
    yield rec
    server.shutdown()


# -- stub engines that record the trace headers they get ---------------------------------


class Stub:
    """An engine speaking enough OpenAI chat for the gateway. `mode`: "ok"; "503" (every request
    fails, retryably); "break" (a stream sends one chunk, then the connection closes)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.seen: list[dict[str, str | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))
                stub.seen.append({k: self.headers.get(k) for k in ("traceparent", "tracestate", "x-request-id")})
                if stub.mode == "503":
                    self._send(503, {"error": {"message": "overloaded", "type": "x", "param": None, "code": 503}})
                elif body.get("stream"):
                    self._stream(body)
                else:
                    self._send(200, {"id": "c1", "object": "chat.completion", "created": 1, "model": body["model"],
                                     "choices": [{"index": 0, "finish_reason": "stop",
                                                  "message": {"role": "assistant", "content": "hello"}}],
                                     "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, body: dict[str, Any]) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes

                def chunk(delta: dict[str, Any], finish: str | None = None) -> None:
                    event = {"id": "s1", "object": "chat.completion.chunk", "created": 1, "model": body["model"],
                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
                    self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    self.wfile.flush()

                chunk({"role": "assistant", "content": ""})
                chunk({"content": "hel"})
                if stub.mode == "break":
                    return  # cut short: no finish_reason, no [DONE]
                chunk({"content": "lo"}, "stop")
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def stubs() -> Iterator[dict[str, Stub]]:
    made = {"ok": Stub(), "bad": Stub("503"), "ok2": Stub(), "broken": Stub("break"), "ok3": Stub()}
    yield made
    for stub in made.values():
        stub.server.shutdown()


def register(fleet: Fleet, workers: dict[str, tuple[Stub, str]]) -> None:
    async def go() -> None:
        redis = connect(fleet.redis_url)
        registry = Registry(redis, fleet.prefix, heartbeat_ttl_s=120)
        for worker_id, (stub, model) in workers.items():
            await registry.register(WorkerInfo(id=worker_id, url=stub.url, engine="vllm", model=model), "ready")
        await redis.aclose()

    asyncio.run(go())


def traced_fleet(
    fleet_factory: Callable[[], Fleet], stubs: dict[str, Stub], env: dict[str, str], *flags: str,
) -> tuple[Proc, str]:
    fleet = fleet_factory()
    proc, url = fleet.gateway("--policy", "round_robin", *flags, env=env)
    register(fleet, {"ok": (stubs["ok"], OK), "bad": (stubs["bad"], RETRY), "ok2": (stubs["ok2"], RETRY),
                     "broken": (stubs["broken"], RESUME), "ok3": (stubs["ok3"], RESUME)})
    wait_until(lambda: {OK, RETRY, RESUME} <= {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]})
    return proc, url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)


def new_parent() -> tuple[str, str, str]:
    """A client's trace id, span id and traceparent (sampled)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"


def chat(url: str, model: str, stream: bool, traceparent: str | None, tracestate: str = "") -> str:
    headers = {"traceparent": traceparent} if traceparent else {}
    if tracestate:
        headers["tracestate"] = tracestate
    messages = [{"role": "user", "content": "hi"}]
    if stream:
        parts = client(url).chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                    stream=True, extra_headers=headers)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)  # type: ignore[union-attr]
    reply = client(url).chat.completions.create(model=model, messages=messages,  # type: ignore[arg-type]
                                                extra_headers=headers)
    return reply.choices[0].message.content or ""


def spans_of(rec: Receiver, trace_id: str, attempts: int) -> tuple[Span, list[Span]]:
    """The request span and its `attempts` attempt spans, once all arrived."""
    def ready() -> bool:
        spans = rec.trace(trace_id)
        return sum(s.name == "fleetgate.attempt" for s in spans) >= attempts and any(
            s.name.startswith("POST ") for s in spans)

    wait_until(ready, timeout=20)
    spans = rec.trace(trace_id)
    request = next(s for s in spans if s.name.startswith("POST "))
    tries = sorted((s for s in spans if s.name == "fleetgate.attempt"), key=lambda s: s.attrs["fleetgate.attempt"])
    return request, tries


def engine_parent(stub: Stub, trace_id: str) -> list[str]:
    """The span ids of the traceparents of `trace_id` that `stub` received."""
    out = []
    for seen in stub.seen:
        parts = (seen["traceparent"] or "").split("-")
        if len(parts) == 4 and parts[1] == trace_id:
            out.append(parts[2])
    return out


FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.mark.parametrize(("stream", "fast_path"), [(False, True), (True, True), (False, False)],
                         ids=["whole", "stream", "whole-litestar"])
def test_request_span_is_the_clients_child_and_the_engine_gets_the_attempt_span(
    fleet_factory: Callable[[], Fleet], stubs: dict[str, Stub], receiver: Receiver, stream: bool, fast_path: bool,
) -> None:
    """The request span joins the client's trace (child of its traceparent) with the routing
    decision on it; one attempt span is its child, and the engine's traceparent names that span
    (same trace id, the attempt's span id) and carries the client's tracestate on. The same
    through Litestar's routes (fast_path off) as through the fast path."""
    _, url = traced_fleet(fleet_factory, stubs, {"FLEETGATE_OTLP_ENDPOINT": receiver.url, **FAST_EXPORT},
                          "--set", f"fast_path={str(fast_path).lower()}")
    trace_id, parent_id, traceparent = new_parent()
    assert chat(url, OK, stream, traceparent, "vendor=42") == "hello"
    request, tries = spans_of(receiver, trace_id, 1)
    assert request.parent_id == parent_id and request.kind == 2  # SPAN_KIND_SERVER
    assert request.service == "fleetgate-gateway"
    attrs = request.attrs
    assert attrs["url.path"] == "/v1/chat/completions" and attrs["fleetgate.model"] == OK
    assert attrs["fleetgate.stream"] is stream and attrs["http.response.status_code"] == 200
    assert attrs["fleetgate.route.policy"] == "round_robin" and attrs["fleetgate.route.worker"] == "ok"
    assert attrs["fleetgate.route.reason"] and attrs["fleetgate.route.candidates"] == ["ok"]
    assert attrs["fleetgate.route.candidate_count"] == 1 and attrs["fleetgate.attempts"] == 1
    if stream:
        assert attrs["fleetgate.outcome"] == "completed"
    [attempt] = tries
    assert attempt.parent_id == request.span_id and attempt.kind == 3  # SPAN_KIND_CLIENT
    assert attempt.attrs["fleetgate.worker.id"] == "ok" and attempt.attrs["http.response.status_code"] == 200
    assert attempt.attrs["url.full"] == stubs["ok"].url + "/v1/chat/completions"
    assert engine_parent(stubs["ok"], trace_id) == [attempt.span_id]
    assert stubs["ok"].seen[-1]["tracestate"] == "vendor=42"


def test_a_retry_gives_two_attempt_spans_each_forwarded_to_its_engine(
    fleet_factory: Callable[[], Fleet], stubs: dict[str, Stub], receiver: Receiver,
) -> None:
    """A request whose first worker answers 503 has two attempt spans under its request span: the
    first in error with the 503, the second answered; a retry event; each engine got its own
    attempt's span id. Without a client traceparent the gateway starts the trace itself."""
    _, url = traced_fleet(fleet_factory, stubs, {"FLEETGATE_OTLP_ENDPOINT": receiver.url, **FAST_EXPORT})
    retried = None
    for _ in range(4):  # round robin: within two requests one goes to the failing worker first
        trace_id, _, traceparent = new_parent()
        assert chat(url, RETRY, False, traceparent) == "hello"
        request, tries = spans_of(receiver, trace_id, 1)
        if len(tries) == 1 and request.attrs["fleetgate.attempts"] == 1:
            continue
        request, tries = spans_of(receiver, trace_id, 2)
        retried = trace_id
        break
    assert retried is not None, "no request went to the failing worker first"
    first, second = tries
    assert first.parent_id == second.parent_id == request.span_id
    assert first.attrs["fleetgate.worker.id"] == "bad" and first.attrs["http.response.status_code"] == 503
    assert first.status == 2 and "503" in first.attrs["fleetgate.error"]  # STATUS_CODE_ERROR
    assert second.attrs["fleetgate.worker.id"] == "ok2" and second.status != 2
    assert request.attrs["fleetgate.attempts"] == 2 and request.attrs["fleetgate.route.worker"] == "ok2"
    assert request.attrs["fleetgate.route.candidate_count"] == 2
    assert [name for name, _ in request.events] == ["fleetgate.retry"]
    assert engine_parent(stubs["bad"], retried) == [first.span_id]
    assert engine_parent(stubs["ok2"], retried) == [second.span_id]
    # No traceparent from the client: a new trace, rooted at the request span.
    assert chat(url, OK, False, None) == "hello"
    wait_until(lambda: any(s.parent_id == "" and s.name.startswith("POST ") for s in receiver.spans))
    root = next(s for s in receiver.spans if s.parent_id == "" and s.name.startswith("POST "))
    assert engine_parent(stubs["ok"], root.trace_id)


def test_a_resumed_stream_has_a_broken_and_a_continuing_attempt(
    fleet_factory: Callable[[], Fleet], stubs: dict[str, Stub], receiver: Receiver,
) -> None:
    """A stream cut short mid-way and continued on another worker: the first attempt span ends
    in error, the request span has stream_broke and stream_resumed events, the second attempt
    span is the continuation's, whose engine got its span id."""
    _, url = traced_fleet(fleet_factory, stubs, {"FLEETGATE_OTLP_ENDPOINT": receiver.url, **FAST_EXPORT})
    for _ in range(4):
        trace_id, _, traceparent = new_parent()
        chat(url, RESUME, True, traceparent)
        request, tries = spans_of(receiver, trace_id, 1)
        if engine_parent(stubs["broken"], trace_id):
            break
    else:
        pytest.fail("no stream went to the breaking worker first")
    request, tries = spans_of(receiver, trace_id, 2)
    first, second = tries
    assert first.attrs["fleetgate.worker.id"] == "broken" and first.status == 2
    assert second.attrs["fleetgate.worker.id"] == "ok3" and second.parent_id == request.span_id
    names = [name for name, _ in request.events]
    assert names == ["fleetgate.stream_broke", "fleetgate.stream_resumed"]
    assert request.events[1][1] == {"fleetgate.worker.id": "ok3", "fleetgate.resumes": 1}
    assert request.attrs["fleetgate.outcome"] == "completed" and request.attrs["fleetgate.resumes"] == 1
    assert engine_parent(stubs["ok3"], trace_id) == [second.span_id]


def test_spans_are_flushed_when_the_gateway_stops(
    fleet_factory: Callable[[], Fleet], stubs: dict[str, Stub], receiver: Receiver,
) -> None:
    """With a batch delay far longer than the test, the spans still arrive: the lifespan shuts the
    provider down (flushing it) when the gateway stops."""
    proc, url = traced_fleet(fleet_factory, stubs, {"FLEETGATE_OTLP_ENDPOINT": receiver.url,
                                                    "OTEL_BSP_SCHEDULE_DELAY": "600000"})
    trace_id, _, traceparent = new_parent()
    assert chat(url, OK, False, traceparent) == "hello"
    time.sleep(0.5)
    assert receiver.trace(trace_id) == []
    proc.stop()  # SIGTERM: uvicorn's graceful shutdown runs the lifespan's exit
    assert "gateway.stopped" in proc.log_path.read_text()
    request, _ = spans_of(receiver, trace_id, 1)
    assert request.attrs["http.response.status_code"] == 200


def test_tracing_off_exports_nothing_and_forwards_the_clients_traceparent(
    fleet_factory: Callable[[], Fleet], stubs: dict[str, Stub], receiver: Receiver,
) -> None:
    """Tracing off (no endpoint set; the SDK's generic OTEL_EXPORTER_OTLP_ENDPOINT does not turn it
    on): the engine gets the client's traceparent and tracestate unchanged, streamed or not, none
    when the client sent none, and nothing is exported, even when the gateway stops."""
    base = receiver.url.removesuffix("/v1/traces")
    proc, url = traced_fleet(fleet_factory, stubs, {"OTEL_EXPORTER_OTLP_ENDPOINT": base, **FAST_EXPORT})
    for stream in (False, True):
        _, _, traceparent = new_parent()
        assert chat(url, OK, stream, traceparent, "vendor=7") == "hello"
        assert stubs["ok"].seen[-1]["traceparent"] == traceparent
        assert stubs["ok"].seen[-1]["tracestate"] == "vendor=7"
    assert chat(url, OK, False, None) == "hello"
    assert stubs["ok"].seen[-1]["traceparent"] is None
    proc.stop()
    assert "gateway.stopped" in proc.log_path.read_text()
    assert receiver.exports == 0
