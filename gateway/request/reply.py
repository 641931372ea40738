"""What the gateway answers for a proxied request (`Reply`: a whole JSON body or an SSE
stream), and a whole answer's bookkeeping, run once it is written (`Answered`): its metrics,
the key's usage, its log line and its trace, none of which delays the client; or, when no model
of its plan answered, the error it gets, settled, logged and counted (`unanswered`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from gateway.errors import GatewayError, ModelNotFound
from gateway.fleet import FleetWatcher
from gateway.observe import outcomes
from gateway.observe.metrics import GatewayMetrics, usage_of
from gateway.observe.tracing import RequestTrace
from gateway.tenants.quota import Ticket

# The request's summary line has always been logged as gateway.proxy's (operators filter on it).
log = structlog.get_logger("gateway.proxy")

__all__ = ["Answered", "Reply", "unanswered"]


@dataclass(slots=True)
class Reply:
    """What the gateway answers: a whole JSON body, or an SSE stream."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None
    # A whole answer's bookkeeping (metrics, usage, its log line, its trace), for whoever writes
    # the answer to call once it is written (`written`): none of it delays the client. Synchronous,
    # so it runs in the loop step that wrote the answer, before the connection's next request.
    after: Callable[[], None] | None = None

    def written(self) -> None:
        """The answer is written: its bookkeeping runs; a bug there is logged, not the client's."""
        after = self.after
        if after is not None:
            try:
                after()
            except Exception:
                log.exception("gateway.internal_error", stage="after_answer")


class Answered:
    """What is left to do for a whole answer once it is written (`Reply.after`)."""

    def __init__(self, metrics: GatewayMetrics, ticket: Ticket | None, model: str, worker_id: str, status: int,
                 elapsed: float, payload: bytes, fields: dict[str, object], trace: RequestTrace,
                 usage: tuple[int, int] | None = None) -> None:
        self.metrics = metrics
        self.ticket = ticket
        self.model = model
        self.worker_id = worker_id
        self.status = status
        self.elapsed = elapsed  # to the answer, not to this bookkeeping
        self.payload = payload
        self.fields = fields
        self.trace = trace
        self._usage = usage  # (prompt, completion) tokens; None: read from the payload when asked

    def usage(self) -> tuple[int, int]:
        if self._usage is None:
            self._usage = usage_of(self.payload) if self.status == 200 else (0, 0)
        return self._usage

    def run(self) -> None:
        status = self.status
        prompt_tokens, completion_tokens = self.usage()
        ticket = self.ticket
        if ticket is not None:
            ticket.settle_buffered(prompt_tokens, completion_tokens, status)  # (no-op once settled)
        self.metrics.request_done(self.model, self.worker_id, status, False, self.elapsed, None,
                                  prompt_tokens, completion_tokens)
        # bind(): the lazy proxy's `info` would be found only after a failed lookup (an
        # AttributeError built and dropped per request); bind() is a plain attribute.
        log.bind().info("gateway.request", **self.fields, status=status, ms=round(self.elapsed * 1000, 2),
                 prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 error=outcomes.error_code(self.payload) if status >= 400 else None)
        self.trace.end(status)


async def unanswered(metrics: GatewayMetrics, watcher: FleetWatcher, exc: GatewayError, first: GatewayError | None,
                     ticket: Ticket | None, model: str, stream: bool, request_id: str, key_id: str, started: float,
                     attempts: int) -> GatewayError:
    """The error the client gets when no model of its plan answered (`exc`, the last one's; but
    where no worker serves a fallback, the `first` model's), settled with the key, logged and counted."""
    if isinstance(exc, ModelNotFound):
        exc = first or watcher.absent(exc, model)
    if ticket is not None:
        await ticket.settle(0, 0, exc.status)
    exc.request_id = request_id
    outcomes.failed(metrics, exc, started, request_id=request_id, key_id=key_id, model=model, stream=stream,
                    attempts=attempts)
    return exc
