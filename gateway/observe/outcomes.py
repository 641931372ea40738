"""The summary line and the counters of a request that got no engine's answer.

Every request ends in exactly one `gateway.request` event. The proxy writes it for the
answers engines gave; these write it for the rest: an error the gateway answered itself
(refused before routing: a bad body, key or rate limit; or after: no worker, engines
failing) and a client that hung up before its answer was ready (status 499, as nginx
counts it).
"""

from __future__ import annotations

import time

import msgspec
import structlog

from gateway.errors import GatewayError
from gateway.observe.metrics import GatewayMetrics

# The proxy's logger: one event name, one logger, whichever module writes the line.
log = structlog.get_logger("gateway.proxy")

CLIENT_GONE = 499


def failed(
    metrics: GatewayMetrics, exc: GatewayError, started: float, *, request_id: str, key_id: str,
    model: str = "", stream: bool = False, attempts: int | None = None,
) -> None:
    """A request the gateway answered with `exc`; `attempts` is None when it was refused
    before any routing decision (key, rate limit, body)."""
    elapsed = time.perf_counter() - started
    metrics.request_done(model, "", exc.status, stream, elapsed)
    metrics.error(exc.status, exc.code)
    if attempts is not None:
        if exc.status in (429, 503):
            # Shed (gateway/accounts/admission.py) names the limit; otherwise the error code says why.
            metrics.shed(model, exc.status, str(getattr(exc, "reason", "") or exc.code or ""))
        metrics.record_decision(request_id, model, "", type(exc).__name__, attempts, exc.status)
    log.info("gateway.request", request_id=request_id, key_id=key_id, model=model, stream=stream,
             status=exc.status, error=exc.code, attempts=attempts or 0, ms=round(elapsed * 1000, 2))


def client_gone(
    metrics: GatewayMetrics, started: float, *, request_id: str, key_id: str, model: str, stream: bool,
) -> None:
    """The client hung up before its answer was ready: the engine's request was closed."""
    elapsed = time.perf_counter() - started
    metrics.request_done(model, "", CLIENT_GONE, stream, elapsed)
    log.info("gateway.request", request_id=request_id, key_id=key_id, model=model, stream=stream,
             status=CLIENT_GONE, outcome="client_gone", ms=round(elapsed * 1000, 2))


class _Error(msgspec.Struct):
    code: str | int | None = None
    type: str | None = None


class _Envelope(msgspec.Struct):
    error: _Error | None = None


_envelope = msgspec.json.Decoder(_Envelope)


def error_code(body: bytes) -> str | None:
    """The `code` (else `type`) of an OpenAI-shaped error body, for the request's log line."""
    try:
        error = _envelope.decode(body).error
    except msgspec.DecodeError:
        return None
    if error is None:
        return None
    return str(error.code) if error.code is not None else error.type
