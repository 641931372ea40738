"""Proxying one OpenAI request: parse the little routing needs, pick a worker, forward, relay.

The body goes to the engine byte for byte. Only the fields routing needs are
decoded (msgspec skips the rest without building objects). A failure before any
byte reached the client is retried on another worker (bounded in attempts and in
time, jittered, one log event each); once a stream has started, bytes are relayed
as they arrive and a client that goes away closes the engine's request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import NoReturn

import aiohttp
import msgspec
import structlog
from litestar import Request, Response
from litestar.response import Stream
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from fleetgate.schema import WorkerView
from gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    ModelNotFound,
    NoWorkerAvailable,
    UpstreamError,
)
from gateway.fleet import FleetWatcher
from gateway.inflight import SharedInflight
from gateway.requests import TokenCounter, affinity, estimate_tokens, parse_request
from gateway.routing import Choice, Policy, RequestFacts, decide
from gateway.settings import GatewaySettings
from gateway.upstream import RETRYABLE_STATUS, Upstream, openai_error_body

log = structlog.get_logger("gateway.proxy")

_FORWARD_HEADERS = {"content-type": "application/json"}
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class _Retryable(Exception):
    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass
class Proxy:
    settings: GatewaySettings
    watcher: FleetWatcher
    upstream: Upstream
    policy: Policy
    inflight: SharedInflight
    tokenizers: dict[str, TokenCounter] = field(default_factory=dict)
    seq: int = 0

    async def handle(self, request: Request, path: str, kind: str) -> Response:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        body = await request.body()
        probe = parse_request(body, kind)
        self.seq += 1
        session = request.headers.get("x-session-id") or probe.user
        key, key_kind = affinity(probe, session) if self.policy.name == "fleet" else (None, None)
        base = self.watcher.snapshot.models.get(probe.model) or probe.model
        counter = self.tokenizers.get(base)
        if counter is not None:
            estimate = floor = counter.count(probe)
        else:
            estimate, floor = estimate_tokens(probe)
        facts = RequestFacts(
            model=probe.model,
            prompt_tokens=estimate,
            max_tokens=probe.max_completion_tokens or probe.max_tokens,
            session=session,
            seq=self.seq,
            adapter=self.watcher.snapshot.models.get(probe.model, "") != "",
            affinity_key=key,
            affinity_kind=key_kind,
        )
        attempt = _Attempt(self, path, body, probe.stream, facts, floor)
        try:
            resp, choice = await attempt.first()
        except _Retryable as first_failure:
            resp, choice = await self._retry(attempt, first_failure)
        worker = choice.worker
        headers = {
            "x-fleetgate-worker": worker.id,
            "x-fleetgate-route": f"{self.policy.name}:{choice.reason}",
            "x-request-id": request_id,
        }
        fields = {
            "request_id": request_id, "model": probe.model, "worker": worker.id,
            "route": choice.reason, "attempts": attempt.count, "status": resp.status,
            "stream": probe.stream,
        }
        if probe.stream and resp.status == 200:
            return Stream(
                self._relay(resp, worker.id, started, fields),
                status_code=200,
                media_type="text/event-stream",
                headers={**headers, **_SSE_HEADERS},
            )
        try:
            data = await self.upstream.read(resp)
        finally:
            resp.release()
            self._done(worker.id)
        if resp.status >= 400:
            data = openai_error_body(resp.status, data)
        log.info("gateway.request", **fields, ms=round((time.perf_counter() - started) * 1000, 2))
        return Response(
            content=data, status_code=resp.status, media_type="application/json", headers=headers,
        )

    async def _retry(self, attempt: _Attempt, failure: _Retryable) -> tuple[aiohttp.ClientResponse, Choice]:
        settings = self.settings
        if settings.retry_attempts <= 1:
            raise failure.error
        retrying = AsyncRetrying(
            stop=stop_after_attempt(settings.retry_attempts - 1) | stop_after_delay(settings.retry_max_s),
            wait=wait_random_exponential(multiplier=settings.retry_backoff_s, max=1.0),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        log.info("gateway.retry", model=attempt.facts.model, attempt=attempt.count, error=failure.error.message)
        try:
            async for state in retrying:
                with state:
                    return await attempt.next()
        except _Retryable as last:
            raise last.error from None
        raise failure.error  # pragma: no cover - tenacity either returns or raises

    async def _relay(
        self, resp: aiohttp.ClientResponse, worker_id: str, started: float, fields: dict[str, object]
    ) -> AsyncIterator[bytes]:
        outcome = "completed"
        first_chunk_ms: float | None = None
        try:
            async for chunk in resp.content.iter_any():
                if first_chunk_ms is None:
                    first_chunk_ms = round((time.perf_counter() - started) * 1000, 2)
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            outcome = f"engine_broke:{type(exc).__name__}"
            yield _sse_error("the engine's stream broke off; the answer is incomplete")
        except BaseException:
            # The client went away (cancellation) or the server is stopping: abort the
            # engine's request by closing its connection instead of reading it to the end.
            outcome = "client_gone"
            raise
        finally:
            if outcome == "completed":
                resp.release()
            else:
                resp.close()
            self._done(worker_id)
            log.info(
                "gateway.request", **fields, outcome=outcome, ttft_ms=first_chunk_ms,
                ms=round((time.perf_counter() - started) * 1000, 2),
            )

    def _done(self, worker_id: str) -> None:
        self.inflight.done(worker_id)


def _sse_error(message: str) -> bytes:
    payload = msgspec.json.encode(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": "stream_interrupted"}}
    )
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


class _Attempt:
    """The attempts at one request: each picks the best worker not tried yet."""

    def __init__(
        self, proxy: Proxy, path: str, body: bytes, stream: bool, facts: RequestFacts, floor: int
    ) -> None:
        self.proxy = proxy
        # The fewest tokens the prompt can have (equal to the estimate with a tokenizer).
        self.floor = floor
        self.path = path
        self.body = body
        self.stream = stream
        self.facts = facts
        # Each attempt decides afresh (the fleet may have changed), skipping these.
        self.tried: list[str] = []
        self.count = 0
        self.last_error: GatewayError | None = None

    async def first(self) -> tuple[aiohttp.ClientResponse, Choice]:
        return await self.next()

    async def next(self) -> tuple[aiohttp.ClientResponse, Choice]:
        proxy = self.proxy
        choice = self._choose()
        worker = choice.worker
        self.tried.append(worker.id)
        self.count += 1
        proxy.inflight.add(worker.id)
        try:
            resp = await proxy.upstream.post(
                worker.info.url + self.path, self.body, _FORWARD_HEADERS, self.stream
            )
        except UpstreamError as exc:
            proxy._done(worker.id)
            self._failed(worker, exc)
        if resp.status in RETRYABLE_STATUS:
            try:
                data = await proxy.upstream.read(resp)
            except UpstreamError:
                data = b""
            finally:
                resp.release()
                proxy._done(worker.id)
            message = openai_error_body(resp.status, data).decode()
            self._failed(worker, UpstreamError(f"engine {worker.id} answered {resp.status}: {message[:300]}"))
        return resp, choice

    def _choose(self) -> Choice:
        proxy = self.proxy
        snapshot = proxy.watcher.snapshot
        decision = decide(snapshot.routes, self.facts, proxy.inflight, proxy.policy, self.tried, limit=1)
        if decision.verdict == "context_length" and self.floor + (self.facts.max_tokens or 0) < decision.limit:
            # Only an estimate says it does not fit: let the roomiest workers' engines decide.
            roomiest = replace(self.facts, prompt_tokens=decision.limit - 1, max_tokens=None)
            decision = decide(snapshot.routes, roomiest, proxy.inflight, proxy.policy, self.tried, limit=1)
        if decision.verdict == "ok" and decision.choices:
            return decision.choices[0]
        if decision.verdict == "unknown_model":
            raise ModelNotFound(
                f"The model `{self.facts.model}` does not exist or no worker serves it.", param="model"
            )
        if decision.verdict == "context_length":
            raise ContextLengthExceeded(
                f"This model's maximum context length is {decision.limit} tokens. However, you "
                f"requested {self.floor + (self.facts.max_tokens or 0)} tokens or more "
                f"({self.floor} in the prompt, {self.facts.max_tokens or 0} for the completion). "
                "Please reduce the length of the prompt or of max_tokens.",
                param="messages",
            )
        if self.last_error is not None:
            raise self.last_error
        raise NoWorkerAvailable(
            f"No worker can serve `{self.facts.model}` right now (all draining or busy); try again shortly.",
            retry_after=1,
        )

    def _failed(self, worker: WorkerView, error: GatewayError) -> NoReturn:
        self.last_error = error
        log.warning("gateway.attempt_failed", worker=worker.id, attempt=self.count, error=error.message)
        raise _Retryable(error)
