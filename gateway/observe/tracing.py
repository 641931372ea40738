"""Tracing across hops: one span per inference request, a child span per upstream attempt.

Off by default (`tracing_endpoint` empty). Off, a request gets a `RequestTrace` whose hooks do
nothing; it only carries the client's W3C `traceparent` / `tracestate` so that the engine
still sees the client's trace (forwarded unchanged). On, `gateway.app.build_tracing` makes the
OpenTelemetry SDK's tracer (gateway/observe/tracing_otel.py, imported only then: the SDK is the
optional `tracing` extra) and every request gets a recording trace:

    POST /v1/chat/completions   (server span; child of the client's traceparent)
      fleetgate.attempt         (client span per upstream request; its context is the
      fleetgate.attempt          traceparent the engine gets)

The proxy calls the same few hooks whichever it is (`described`, `attempt`,
`attempt_status`, `attempt_end`, `retry`, `stream_broke`, `resumed`, `end`), so the call
sites never branch on whether tracing is on. The tracer is built by the lifespan and
passed down; the SDK's global provider is never set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.routing import Choice

Header = Callable[[str], str | None]


def client_trace_headers(header: Header) -> dict[str, str]:
    """The client's W3C trace context headers (empty when it sent none)."""
    parent = header("traceparent")
    if parent is None:
        return {}
    state = header("tracestate")
    return {"traceparent": parent, "tracestate": state} if state else {"traceparent": parent}


class RequestTrace:
    """One request's trace with tracing off: the client's trace headers to forward, no spans."""

    __slots__ = ("forward",)

    def __init__(self, forward: Mapping[str, str]) -> None:
        # Added to every upstream request's headers (gateway/request/proxy.py).
        self.forward = forward

    def described(self, model: str, stream: bool) -> None:
        """The request's body was read: what it asks for."""

    def attempt(
        self, headers: Mapping[str, str], choice: Choice, url: str, policy: str,
        candidates: Callable[[], Sequence[str]],
    ) -> Mapping[str, str]:
        """An upstream request starts on `choice`, decided by `policy` among `candidates()`
        (the model's routable workers not tried yet): the headers to send it with."""
        return headers

    def attempt_status(self, status: int) -> None:
        """The engine's response status arrived."""

    def attempt_end(self, error: str = "") -> None:
        """The upstream request is over (`error`: why it failed)."""

    def retry(self, number: int, error: str) -> None:
        """Attempt `number` is about to go to another worker after `error`."""

    def stream_broke(self, worker_id: str, reason: str) -> None:
        """The engine's stream died or stalled mid-way."""

    def resumed(self, worker_id: str, resumes: int) -> None:
        """The stream goes on at `worker_id`."""

    def end(self, status: int, outcome: str = "", error: str | None = None) -> None:
        """The request is answered (for a stream: the stream ended)."""


NO_TRACE = RequestTrace({})


class Tracing:
    """Tracing off: `start` looks up one header (two when the client sent a traceparent)."""

    enabled = False

    def start(self, header: Header, path: str, request_id: str) -> RequestTrace:
        forward = client_trace_headers(header)
        return RequestTrace(forward) if forward else NO_TRACE

    async def shutdown(self) -> None:
        """Flush what is not exported yet, and stop exporting."""


__all__ = ["NO_TRACE", "RequestTrace", "Tracing", "client_trace_headers"]
