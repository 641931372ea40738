"""The gateway's error tree. Every failure a client can see is one of these.

    GatewayError                     (status, OpenAI `type`, `code`)
    ├── InvalidRequest               400 invalid_request_error
    │   ├── ContextLengthExceeded    400 invalid_request_error / context_length_exceeded
    │   ├── RequestTooLarge          413 invalid_request_error / request_too_large (the body limit)
    │   ├── RequestTimeout           408 invalid_request_error / request_timeout (a body too slow)
    │   ├── RequestLineTooLong       414 invalid_request_error / request_line_too_long
    │   └── HeaderTooLarge           431 invalid_request_error / request_header_too_large
    ├── Unauthorized                 401 authentication_error / invalid_api_key
    ├── NotFound                     404 invalid_request_error / not_found
    │   └── ModelNotFound            404 invalid_request_error / model_not_found
    ├── Overloaded                   429 rate_limit_error / fleet_overloaded (+ Retry-After)
    ├── Forbidden                    403 permission_error
    │   └── ModelNotAllowed          403 permission_error / model_not_allowed (the key may not use it)
    ├── RateLimited                  429 requests / rate_limit_exceeded (+ Retry-After, x-ratelimit-*)
    │   ├── TokensLimited            429 tokens / rate_limit_exceeded (a tokens-per-minute limit)
    │   └── QuotaExhausted           429 insufficient_quota / insufficient_quota (a token budget)
    ├── NoWorkerAvailable            503 service_unavailable / no_worker_available (+ Retry-After),
    │                                    model_unavailable (served recently, no worker now),
    │                                    registry_unavailable (Redis cannot be read),
    │                                    workers_unreachable (no worker tried could be reached)
    ├── GatewayBusy                  503 service_unavailable / connection_limit (+ Retry-After)
    └── UpstreamError                502 upstream_error / engine_error
        ├── EngineUnreachable        502 upstream_error / engine_unreachable (one attempt's)
        └── UpstreamTimeout          504 upstream_error / engine_timeout

An engine's address never reaches a client: an `UpstreamError`'s `message` says what
failed, its `detail` (for the log, the circuit's reason in the admin API, traces) also
where.

Foreign exceptions (the engines' connections, Redis, msgspec) are translated into this tree once,
where they are raised (`raise X(...) from exc`); one exception handler renders it as
OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import msgspec
from redis import exceptions as redis_errors


class ErrorBody(msgspec.Struct):
    """OpenAI's error object. `code` is a string of the gateway's, or an engine's own code
    (vLLM's is the HTTP status, an integer), relayed in this same shape."""

    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorBody


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str | None = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        # Set once the request has an id, so every answer carries x-request-id.
        self.request_id: str | None = None

    def body(self) -> bytes:
        return msgspec.json.encode(
            ErrorEnvelope(ErrorBody(self.message, self.type, self.param, self.code))
        )

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.retry_after is not None:
            out["retry-after"] = str(max(1, round(self.retry_after)))
        if self.request_id:
            out["x-request-id"] = self.request_id
        return out


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class RequestTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"

    @classmethod
    def over(cls, limit: int) -> RequestTooLarge:
        return cls(f"The request body is over the gateway's limit of {limit} bytes.")


# The limits on a client's connection (gateway/front/front_limits.py).
class RequestTimeout(InvalidRequest):
    status = 408
    code = "request_timeout"


class RequestLineTooLong(InvalidRequest):
    status = 414
    code = "request_line_too_long"


class HeaderTooLarge(InvalidRequest):
    status = 431
    code = "request_header_too_large"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class ModelNotAllowed(Forbidden):
    code = "model_not_allowed"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Overloaded(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "fleet_overloaded"


class RateLimited(GatewayError):
    """One client (API key) sent more than its share: OpenAI's own shape for a request limit."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: float | None, limit_headers: dict[str, str]) -> None:
        super().__init__(message, retry_after=retry_after)
        self.limit_headers = limit_headers

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **self.limit_headers}


class TokensLimited(RateLimited):
    """A key or team sent more tokens per minute than its limit."""

    type = "tokens"


class QuotaExhausted(RateLimited):
    """A key or team used its token budget (per day or in total): OpenAI's shape for it."""

    type = "insufficient_quota"
    code = "insufficient_quota"


class NoWorkerAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_worker_available"


class GatewayBusy(GatewayError):
    """The process holds as many client connections as it may (gateway/front/front_limits.py)."""

    status = 503
    type = "service_unavailable"
    code = "connection_limit"


# Redis is out of reach (down, failing over, or a replica answering READONLY): a 503 the
# client retries, never a 500. Other Redis errors are bugs and stay 500s.
REGISTRY_ERRORS: tuple[type[Exception], ...] = (
    redis_errors.ConnectionError, redis_errors.TimeoutError, redis_errors.ReadOnlyError,
)


def registry_unavailable() -> NoWorkerAvailable:
    return NoWorkerAvailable(
        "The gateway cannot reach its worker registry (Redis) right now; try again shortly.",
        code="registry_unavailable", retry_after=2,
    )


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "engine_error"

    def __init__(self, message: str, *, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail or message


class EngineUnreachable(UpstreamError):
    """No connection to the engine, or it closed before answering: the engine saw nothing
    of the request, or died with it. When every attempt ends so, the client gets a 503
    (`workers_unreachable`): the fleet is changing under the registry's view of it."""

    code = "engine_unreachable"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "engine_timeout"


def detail(error: GatewayError) -> str:
    """What the log and the operator see of `error`: its message, and where when it has one."""
    return error.detail if isinstance(error, UpstreamError) else error.message
