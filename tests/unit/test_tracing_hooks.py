"""gateway/observe/tracing.py and its SDK half: what a request's hooks record and forward, off and on (the
real OpenTelemetry SDK, its in-memory exporter), and the settings that turn tracing on."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from opentelemetry import trace as trace_api
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from gateway.app import build_tracing
from gateway.observe.tracing import NO_TRACE, Tracing
from gateway.observe.tracing_otel import OtelTracing
from gateway.settings import load_settings

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"
HEADERS = {"content-type": "application/json", "x-request-id": "r1"}


def _candidates(tried: list[str]) -> tuple[str, Callable[[], list[str]]]:
    """The policy and the candidates an Attempt hands the hook (its model's workers not tried
    before this attempt's)."""
    return "fleet", lambda: [w for w in ("w1", "w2", "w3") if w not in tried[:-1]]


def _choice(worker: str, reason: str = "least-load") -> Any:
    return SimpleNamespace(worker=SimpleNamespace(id=worker), reason=reason)


def _read(headers: dict[str, str]) -> Callable[[str], str | None]:
    """A request's header reader, as the proxy gets one."""
    return headers.get


def _parent_of(traceparent: str) -> tuple[str, str]:
    _, trace_id, span_id, _ = traceparent.split("-")
    return trace_id, span_id


def test_off_records_nothing_and_forwards_the_clients_trace_headers_unchanged() -> None:
    """Off, a request without a traceparent gets the shared no-op trace; one with it forwards it and
    its tracestate as they came, and the attempt hook hands the same headers back."""
    off = Tracing()
    assert off.start(_read({}), "/v1/completions", "r1") is NO_TRACE and NO_TRACE.forward == {}
    trace = off.start(_read({"traceparent": TRACEPARENT, "tracestate": "a=1"}), "/v1/completions", "r1")
    assert trace.forward == {"traceparent": TRACEPARENT, "tracestate": "a=1"}
    headers = {**HEADERS, **trace.forward}
    assert trace.attempt(headers, _choice("w1"), "http://w1/v1/completions", *_candidates(["w1"])) is headers
    assert build_tracing(load_settings(None, environ={}), "gw-1").enabled is False


def test_on_the_request_span_is_the_clients_child_and_each_attempt_is_forwarded() -> None:
    """On, the request span is a server span under the client's traceparent; each attempt is a
    client span under it whose own context replaces the client's traceparent in the engine's
    headers (tracestate carried on); a failed attempt is in error, the retry is an event, and the
    routing decision and outcome end up on the request span. No global provider is set."""
    exporter = InMemorySpanExporter()
    tracing = OtelTracing.with_processor(SimpleSpanProcessor(exporter), "gw-test", "gw-1")
    trace = tracing.start(_read({"traceparent": TRACEPARENT, "tracestate": "a=1"}), "/v1/chat/completions", "r1")
    assert trace.forward == {}
    trace.described("m", True)
    base = {**HEADERS, **trace.forward}
    first = trace.attempt(base, _choice("w1", "prefix-hit"), "http://w1/v1/chat/completions", *_candidates(["w1"]))
    trace.attempt_status(503)
    trace.attempt_end("engine w1 answered 503")
    trace.retry(2, "engine w1 answered 503")
    second = trace.attempt(base, _choice("w2"), "http://w2/v1/chat/completions", *_candidates(["w1", "w2"]))
    trace.attempt_status(200)
    trace.end(200, "completed")
    trace.end(200, "completed")  # a second end (stream and proxy both) is ignored

    spans = {s.name: s for s in exporter.get_finished_spans() if s.name != "fleetgate.attempt"}
    attempts = [s for s in exporter.get_finished_spans() if s.name == "fleetgate.attempt"]
    request = spans["POST /v1/chat/completions"]
    assert len(exporter.get_finished_spans()) == 3
    assert request.kind is SpanKind.SERVER and request.parent is not None
    assert f"{request.context.trace_id:032x}" == TRACE_ID and f"{request.parent.span_id:016x}" == PARENT
    assert request.resource.attributes["service.name"] == "gw-test"
    assert dict(request.attributes or {}) == {
        "http.request.method": "POST", "url.path": "/v1/chat/completions", "fleetgate.request_id": "r1",
        "fleetgate.model": "m", "fleetgate.stream": True, "fleetgate.route.policy": "fleet",
        "fleetgate.route.reason": "least-load", "fleetgate.route.worker": "w2",
        "fleetgate.route.candidates": ("w1", "w2", "w3"), "fleetgate.route.candidate_count": 3,
        "http.response.status_code": 200, "fleetgate.attempts": 2, "fleetgate.outcome": "completed",
    }
    assert [e.name for e in request.events] == ["fleetgate.retry"]
    one, two = sorted(attempts, key=lambda s: int((s.attributes or {})["fleetgate.attempt"]))  # type: ignore[arg-type]
    for span, headers in ((one, first), (two, second)):
        assert span.kind is SpanKind.CLIENT and span.parent is not None
        assert span.parent.span_id == request.context.span_id
        assert _parent_of(headers["traceparent"]) == (TRACE_ID, f"{span.context.span_id:016x}")
        assert headers["tracestate"] == "a=1" and headers["x-request-id"] == "r1"
    assert one.status.status_code is StatusCode.ERROR and (one.attributes or {})["http.response.status_code"] == 503
    assert (one.attributes or {})["fleetgate.route.reason"] == "prefix-hit"
    assert (two.attributes or {})["fleetgate.route.candidate_count"] == 2  # w1 was tried already
    assert two.status.status_code is not StatusCode.ERROR
    assert not isinstance(trace_api.get_tracer_provider(), type(tracing.provider))
    tracing.provider.shutdown()


def test_a_gateway_error_and_a_broken_stream_mark_the_request_span() -> None:
    """A 5xx the gateway answered, and a stream that broke for good, leave the request span in
    error with what went wrong; a 4xx does not (the client's fault, not the server's)."""
    exporter = InMemorySpanExporter()
    tracing = OtelTracing.with_processor(SimpleSpanProcessor(exporter), "gw-test", "gw-1")
    tracing.start(_read({}), "/v1/completions", "a").end(503, error="no_worker_available")
    tracing.start(_read({}), "/v1/completions", "b").end(404, error="model_not_found")
    broken = tracing.start(_read({}), "/v1/completions", "c")
    broken.attempt(HEADERS, _choice("w1"), "http://w1/v1/completions", *_candidates(["w1"]))
    broken.stream_broke("w1", "stalled")
    broken.end(200, "broken:stalled")
    by_id = {(s.attributes or {}).get("fleetgate.request_id"): s for s in exporter.get_finished_spans()}
    assert by_id["a"].status.status_code is StatusCode.ERROR
    assert (by_id["a"].attributes or {})["error.type"] == "no_worker_available"
    assert by_id["b"].status.status_code is StatusCode.UNSET
    assert by_id["c"].status.status_code is StatusCode.ERROR and by_id["c"].parent is None
    [attempt] = [s for s in exporter.get_finished_spans() if s.name == "fleetgate.attempt"]
    assert attempt.status.status_code is StatusCode.ERROR and attempt.status.description == "stream stalled"
    tracing.provider.shutdown()


def test_settings_turn_tracing_on_by_fleetgates_variable_or_the_standard_one() -> None:
    """FLEETGATE_OTLP_ENDPOINT sets the endpoint, and wins over OTEL_EXPORTER_OTLP_TRACES_ENDPOINT;
    OTEL_SERVICE_NAME names the service; credentials in the URL are masked in what is logged."""
    std = "http://std:4318/v1/traces"
    assert load_settings(None, environ={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": std}).tracing_endpoint == std
    both = load_settings(None, environ={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": std, "OTEL_SERVICE_NAME": "edge",
                                        "FLEETGATE_OTLP_ENDPOINT": "http://u:p@mine:4318/v1/traces"})
    assert both.tracing_endpoint == "http://u:p@mine:4318/v1/traces" and both.tracing_service == "edge"
    assert both.public()["tracing_endpoint"] == "http://***@mine:4318/v1/traces"
    assert load_settings(None, environ={}).tracing_endpoint == ""
