"""The OpenTelemetry SDK behind gateway/observe/tracing.py: spans exported over OTLP/HTTP.

Imported only when tracing is on. The provider is the gateway's own (built by the
lifespan, shut down with it), never the SDK's global one; the context goes from the
request span to each attempt span explicitly, never through the ambient context.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.observe.tracing import Header, RequestTrace, Tracing, client_trace_headers

if TYPE_CHECKING:
    from gateway.routing import Choice

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent / tracestate


class OtelTracing(Tracing):
    enabled = True

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("fleetgate.gateway")

    @classmethod
    def exporting(cls, endpoint: str, service: str, instance_id: str) -> OtelTracing:
        """Spans batched and sent to the OTLP/HTTP traces URL `endpoint`."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return cls.with_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)), service, instance_id)

    @classmethod
    def with_processor(cls, processor: SpanProcessor, service: str, instance_id: str) -> OtelTracing:
        resource = Resource.create({"service.name": service, "service.instance.id": instance_id})
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(processor)
        return cls(provider)

    def start(self, header: Header, path: str, request_id: str) -> RequestTrace:
        carrier = client_trace_headers(header)
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        span = self.tracer.start_span(
            f"POST {path}", context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": path, "fleetgate.request_id": request_id},
        )
        return SpanTrace(self, span)

    async def shutdown(self) -> None:
        # Flushes the batch (the exporter's own timeout bounds it) off the event loop.
        await asyncio.to_thread(self.provider.shutdown)


class SpanTrace(RequestTrace):
    """One request's spans: the server span, and the upstream attempt in progress."""

    __slots__ = ("_attempt", "_attempts", "_attrs", "_ended", "_tracing", "span")

    def __init__(self, tracing: OtelTracing, span: Span) -> None:
        super().__init__({})  # the propagator writes each attempt's own traceparent
        self._tracing = tracing
        self.span = span
        self._attempt: Span | None = None
        self._attempts = 0
        self._ended = False
        # The request span's attributes, set once when it ends (each SDK call validates and locks).
        self._attrs: dict[str, str | bool | int | list[str]] = {}

    def described(self, model: str, stream: bool) -> None:
        self._attrs.update({"fleetgate.model": model, "fleetgate.stream": stream})

    def attempt(
        self, headers: Mapping[str, str], choice: Choice, url: str, policy: str,
        candidates: Callable[[], Sequence[str]],
    ) -> Mapping[str, str]:
        self.attempt_end()  # one left open (an engine's context refusal, retried elsewhere)
        self._attempts += 1
        worker = choice.worker.id
        among = list(candidates())
        route = {"fleetgate.route.policy": policy, "fleetgate.route.reason": choice.reason,
                 "fleetgate.route.worker": worker}
        self._attrs.update(route)
        if self._attempts == 1:  # the first decision saw the whole fleet for this model
            self._attrs.update({"fleetgate.route.candidates": among,
                                "fleetgate.route.candidate_count": len(among)})
        self._attempt = span = self._tracing.tracer.start_span(
            "fleetgate.attempt", context=set_span_in_context(self.span), kind=SpanKind.CLIENT,
            attributes={**route, "fleetgate.attempt": self._attempts, "fleetgate.worker.id": worker,
                        "url.full": url, "http.request.method": "POST",
                        "fleetgate.route.candidate_count": len(among)},
        )
        out = {k: v for k, v in headers.items() if k not in ("traceparent", "tracestate")}
        _PROPAGATOR.inject(out, context=set_span_in_context(span))
        return out

    def attempt_status(self, status: int) -> None:
        if self._attempt is not None:
            self._attempt.set_attribute("http.response.status_code", status)
            if status >= 400:
                self._attempt.set_attribute("error.type", str(status))

    def attempt_end(self, error: str = "") -> None:
        span, self._attempt = self._attempt, None
        if span is None:
            return
        if error:
            span.set_status(Status(StatusCode.ERROR, error))
            span.set_attribute("fleetgate.error", error)
        span.end()

    def retry(self, number: int, error: str) -> None:
        self.span.add_event("fleetgate.retry", {"fleetgate.attempt": number, "fleetgate.error": error})

    def stream_broke(self, worker_id: str, reason: str) -> None:
        self.attempt_end(f"stream {reason}")
        self.span.add_event("fleetgate.stream_broke", {"fleetgate.worker.id": worker_id, "fleetgate.reason": reason})

    def resumed(self, worker_id: str, resumes: int) -> None:
        self.span.add_event("fleetgate.stream_resumed", {"fleetgate.worker.id": worker_id, "fleetgate.resumes": resumes})
        self._attrs["fleetgate.resumes"] = resumes

    def end(self, status: int, outcome: str = "", error: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        self.attempt_end(outcome if outcome in ("client_gone", "client_stalled") else "")
        span = self.span
        attrs = self._attrs
        attrs.update({"http.response.status_code": status, "fleetgate.attempts": self._attempts})
        if outcome:
            attrs["fleetgate.outcome"] = outcome
        if error:
            attrs["error.type"] = error
        span.set_attributes(attrs)
        if status >= 500 or outcome.startswith("broken"):
            span.set_status(Status(StatusCode.ERROR, error or outcome))
        span.end()


__all__ = ["OtelTracing", "SpanTrace"]
