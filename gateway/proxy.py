"""Proxying one OpenAI request: parse the little routing needs, pick a worker, forward, relay.

The body goes to the engine byte for byte. Only the fields routing needs are
decoded. A failure before any byte reached the client (refused connection,
timeout, engine 5xx/429, a body cut short) is retried on another worker, bounded
in attempts and in time, with jittered backoff and one log event per retry. Once a
stream has started, events are relayed as they arrive; if the engine dies or
stalls mid-stream, the stream is continued on another worker (gateway/resume.py).
When every eligible worker is full by the gateway's own account, the request waits in a
bounded FIFO queue woken by completions (gateway/admission.py), then gets 429 +
Retry-After. A client that goes away closes the engine's request (gateway/front.py).
The engine gets the request's `x-request-id`; a stream always asks it for usage.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import NoReturn

import aiohttp
import structlog
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from fleetgate.schema import WorkerView
from gateway import outcomes
from gateway.adapters import AdapterPlacer
from gateway.admission import Admission
from gateway.capabilities import continues_trailing_assistant, shaped
from gateway.circuit import Breakers
from gateway.context import error_message, refit, refused_prompt_tokens
from gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoWorkerAvailable,
    Overloaded,
    UpstreamError,
)
from gateway.fleet import FleetWatcher
from gateway.inflight import SharedInflight
from gateway.metrics import GatewayMetrics, usage_of
from gateway.placement import Placement
from gateway.requests import (
    GENERATES,
    affinity,
    estimate_tokens,
    parse_request,
    shared_prefix_tokens,
)
from gateway.responses import ResponsesTracker, forward_stored, owner_of, remember, response_id_of
from gateway.resume import StreamTracker, continuation, unresumable, with_usage
from gateway.routing import Choice, Live, Policy, RequestFacts, decide
from gateway.routing.table import Slot
from gateway.settings import GatewaySettings
from gateway.tokenizers import Tokenizers
from gateway.upstream import RETRYABLE_STATUS, Upstream, openai_error_body
from gateway.waiting import FirstByteWaits, WorkerWentAway

log = structlog.get_logger("gateway.proxy")

_FORWARD_HEADERS = {"content-type": "application/json"}
# What a request without max_tokens is expected to generate, for the KV account.
_DEFAULT_COMPLETION_TOKENS = 256


@dataclass(slots=True)
class Reply:
    """What the gateway answers: a whole JSON body, or an SSE stream."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes = b""
    stream: AsyncIterator[bytes] | None = None


class _Retryable(Exception):
    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class _Held(Exception):
    """The chosen worker's KV cache is full by the account: wait there a moment (`Proxy._hold`)."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot


class _Saturated(Exception):
    """Every eligible worker is full: the request waits in the gateway's queue."""


class _StreamBroke(Exception):
    """The engine's stream ended without finishing."""


@dataclass
class Proxy:
    settings: GatewaySettings
    watcher: FleetWatcher
    upstream: Upstream
    policy: Policy
    inflight: SharedInflight
    breakers: Breakers
    metrics: GatewayMetrics
    placer: AdapterPlacer
    placement: Placement
    admission: Admission
    tokenizers: Tokenizers = field(default_factory=Tokenizers)
    seq: int = 0
    live: Live = field(init=False)
    waits: FirstByteWaits = field(init=False)

    def __post_init__(self) -> None:
        self.waits = FirstByteWaits(lambda: self.watcher.snapshot)
        self.live = self.placement.live(Live(self.inflight, self.inflight.tokens))
        self.inflight.on_done = self.admission.wake
    # Request ids: a random per-process prefix and a counter (no syscall per request).
    _id_prefix: str = field(default_factory=lambda: uuid.uuid4().hex[:16])

    def _next_id(self) -> str:
        return f"{self._id_prefix}{self.seq:016x}"

    async def serve(
        self, body: bytes, header: Callable[[str], str | None], path: str, kind: str, key_id: str = ""
    ) -> Reply:
        """Route and forward one OpenAI request. `header(name)` reads a request header.

        Raises GatewayError (with its `request_id` set) for every answer the gateway
        gives itself; engine answers, errors included, come back as a Reply.
        """
        started = time.perf_counter()
        self.seq += 1
        request_id = header("x-request-id") or self._next_id()
        try:
            return await self._serve(body, header, path, kind, key_id, request_id, started)
        except GatewayError as exc:
            if exc.request_id is None:  # refused before routing (a bad body): not logged yet
                exc.request_id = request_id
                outcomes.failed(self.metrics, exc, started, request_id=request_id, key_id=key_id)
            raise

    async def _serve(
        self, body: bytes, header: Callable[[str], str | None], path: str, kind: str, key_id: str,
        request_id: str, started: float,
    ) -> Reply:
        probe = parse_request(body, kind)
        snapshot = self.watcher.snapshot
        session = header("x-session-id") or probe.user
        is_adapter = snapshot.models.get(probe.model, "") != ""
        generates = kind in GENERATES
        key, key_kind = (None, None)
        if generates and self.policy.name == "fleet":
            key, key_kind = affinity(probe, session, is_adapter)
        base = snapshot.models.get(probe.model) or probe.model
        counter = self.tokenizers.get(base)
        if kind in ("tokenize", "detokenize"):
            estimate = floor = 0  # any length may be tokenized; no context to fit
        elif counter is not None:
            estimate = floor = counter.count(probe)
        else:
            estimate, floor = estimate_tokens(probe)
        warm, full = self.placer.residency(probe.model) if is_adapter else (frozenset(), frozenset())
        pinned = None
        if probe.previous_response_id is not None:
            owner = await owner_of(self.watcher, probe.previous_response_id, "previous_response_id")
            pinned = owner.info.id
            if not owner.serves(probe.model):
                raise InvalidRequest(f"Response `{probe.previous_response_id}` is stored on worker `{pinned}`, "
                                     f"which does not serve `{probe.model}`; continue it with a model it "
                                     "serves.", param="model")
        facts = RequestFacts(
            model=probe.model,
            prompt_tokens=estimate,
            max_tokens=probe.max_new_tokens,
            session=session,
            seq=self.seq,
            adapter=is_adapter,
            warm=warm,
            full=full,
            affinity_key=key,
            affinity_kind=key_kind,
            pinned=pinned,
            pooling=True if kind == "embeddings" else False if generates else None,
            prefix_tokens=shared_prefix_tokens(probe, key_kind, estimate),
        )
        hide_usage = probe.stream and kind in ("chat", "completion") and not probe.wants_usage
        if hide_usage:  # count every stream's tokens: ask the engine for usage anyway
            body = with_usage(body)
        attempt = _Attempt(self, path, kind, body, probe.stream, facts, floor)
        attempt.headers = {**_FORWARD_HEADERS, "x-request-id": request_id}
        try:
            if facts.adapter and self.placer.known(probe.model):
                await self.placer.ensure(probe.model)
            while True:
                try:
                    result = await attempt.next()
                    break
                except ModelNotFound:
                    if not (facts.adapter and self.placer.known(probe.model)) or attempt.replaced:
                        raise
                    attempt.replaced = True  # evicted between its placement and now: place it again
                    await self.placer.ensure(probe.model)
                except _Saturated:
                    await self._wait_for_room(attempt)
                except _Held as held:
                    await self._hold(attempt, held.slot)
                except _Retryable as first_failure:
                    result = await self._retry(attempt, first_failure)
                    break
        except GatewayError as exc:
            error = self.watcher.absent(exc, probe.model) if isinstance(exc, ModelNotFound) else exc
            self._failed_request(request_id, key_id, probe.model, probe.stream, attempt, error, started)
            raise error from None
        except asyncio.CancelledError:  # the client hung up (gateway/front.py) or the server stops
            outcomes.client_gone(self.metrics, started, request_id=request_id, key_id=key_id, model=probe.model,
                                 stream=probe.stream)
            raise
        choice, resp, data = result
        worker = choice.worker
        route = f"{self.policy.name}:{choice.reason}"
        self.metrics.record_decision(request_id, probe.model, worker.id, route, attempt.count,
                                     200 if resp is not None else data[0])
        if attempt.count > 1:
            self.metrics.failover(probe.model)
        headers = [
            ("x-fleetgate-worker", worker.id),
            ("x-fleetgate-route", route),
            ("x-request-id", request_id),
        ]
        fields = {
            "request_id": request_id, "key_id": key_id, "model": probe.model, "adapter": facts.adapter,
            "worker": worker.id, "route": choice.reason, "attempts": attempt.count, "stream": probe.stream,
        }
        stores = kind == "responses" and probe.store is not False
        if resp is not None:
            tracker: StreamTracker | ResponsesTracker = (
                ResponsesTracker() if kind == "responses"
                else StreamTracker(kind, lambda sent: unresumable(body, kind, sent), hide_usage)
            )
            return Reply(200, headers, stream=self._relay(attempt, choice, resp, tracker, started, fields, stores))
        status, payload = data
        if stores and status == 200 and (response_id := response_id_of(payload)):
            await remember(self.watcher, response_id, worker.id, self.settings.responses_ttl_s)
        elapsed = time.perf_counter() - started
        prompt_tokens, completion_tokens = usage_of(payload) if status == 200 else (0, 0)
        self.metrics.request_done(probe.model, worker.id, status, False, elapsed, None,
                                  prompt_tokens, completion_tokens)
        log.info("gateway.request", **fields, status=status, ms=round(elapsed * 1000, 2),
                 prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 error=outcomes.error_code(payload) if status >= 400 else None)
        return Reply(status, headers, body=payload)

    def _failed_request(
        self, request_id: str, key_id: str, model: str, stream: bool, attempt: _Attempt, exc: GatewayError,
        started: float,
    ) -> None:
        exc.request_id = request_id
        outcomes.failed(self.metrics, exc, started, request_id=request_id, key_id=key_id, model=model,
                        stream=stream, attempts=attempt.count)

    def refused(self, exc: GatewayError, header: Callable[[str], str | None], key_id: str, started: float) -> None:
        """Log and count a request refused before `serve` (its key, rate limit or body)."""
        self.seq += 1
        exc.request_id = header("x-request-id") or self._next_id()
        outcomes.failed(self.metrics, exc, started, request_id=exc.request_id, key_id=key_id)

    async def _wait_for_room(self, attempt: _Attempt) -> None:
        """Hold a request while every eligible worker is full; bounded in count and time."""
        settings = self.settings
        if attempt.queue_deadline is None:
            attempt.queue_deadline = time.monotonic() + settings.queue_timeout_s
        await self.admission.wait(attempt.facts.model, attempt.saturated, attempt.queue_deadline,
                                  retry_after=max(1.0, settings.queue_timeout_s / 2))

    async def _hold(self, attempt: _Attempt, slot: Slot) -> None:
        """Wait, at most `hold_max_s`, until `slot` has KV room for the request by the account
        (a completion there wakes it), rather than have its engine preempt to admit it."""
        attempt.held = True
        full_at, live, tokens = self.settings.full_at, self.live, attempt.own_tokens
        got = await self.admission.hold(slot.id, lambda: not full_at.holds(slot, live, tokens),
                                        time.monotonic() + self.settings.hold_max_s)
        log.debug("gateway.hold", worker_id=slot.id, model=attempt.facts.model, room=got)

    async def _retry(self, attempt: _Attempt, failure: _Retryable) -> _Result:
        settings = self.settings
        if settings.retry_attempts <= 1:
            raise failure.error
        retrying = AsyncRetrying(
            stop=stop_after_attempt(settings.retry_attempts - 1) | stop_after_delay(settings.retry_max_s),
            wait=wait_random_exponential(multiplier=settings.retry_backoff_s, max=1.0),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
            before=lambda state: self._log_retry(attempt),
        )
        try:
            async for state in retrying:
                with state:
                    return await attempt.next()
        except _Retryable as last:
            raise last.error from None
        raise failure.error  # pragma: no cover - tenacity either returns or raises

    def _log_retry(self, attempt: _Attempt) -> None:
        self.metrics.retry(attempt.facts.model)
        log.info("gateway.retry", model=attempt.facts.model, attempt=attempt.count + 1,
                 error=attempt.last_error.message if attempt.last_error else "")

    async def stored(self, method: str, response_id: str, suffix: str, query: str) -> Reply:
        """Forward a retrieve (GET) or cancel (POST) of a stored response to the worker that has it."""
        worker = await owner_of(self.watcher, response_id, "response_id")
        status, content_type, data = await forward_stored(
            self.upstream, worker, method, f"{response_id}{suffix}", query, self.settings.first_byte_timeout_s)
        return Reply(status, [("x-fleetgate-worker", worker.info.id), ("content-type", content_type)], body=data)

    async def _relay(
        self, attempt: _Attempt, choice: Choice, resp: aiohttp.ClientResponse,
        tracker: StreamTracker | ResponsesTracker, started: float, fields: dict[str, object], stores: bool,
    ) -> AsyncIterator[bytes]:
        settings = self.settings
        loop = asyncio.get_running_loop()
        worker = choice.worker
        outcome = "completed"
        first_chunk_ms: float | None = None
        resumes = 0
        counted = True  # `worker` holds one of this gateway's in-flight counts
        tokens = (0, 0)
        try:
            while True:
                try:
                    buffer = b""
                    # The first event may wait behind the engine's queue; later ones may not stall.
                    async with asyncio.timeout(attempt.first_byte_timeout()) as deadline:
                        async for data in self.waits.first_event(worker.id, resp.content.iter_any()):
                            deadline.reschedule(loop.time() + settings.stall_timeout_s)
                            *events, buffer = (buffer + data).split(b"\n\n")
                            if not events:
                                continue
                            # What arrived in one read leaves in one write.
                            out = [x for e in events if (x := tracker.on_event(e.strip(b"\r\n"))) is not None]
                            if not out:
                                continue
                            if first_chunk_ms is None:
                                first_chunk_ms = round((time.perf_counter() - started) * 1000, 2)
                            joined = b"".join(out)
                            if stores and tracker.response_id:
                                # Recorded before the client can see the id, so a follow-up finds it.
                                await remember(self.watcher, tracker.response_id, worker.id,
                                               self.settings.responses_ttl_s)
                                stores = False
                            if b'"usage":{' in joined or b'"usage": {' in joined:
                                for piece in out:
                                    usage = usage_of(piece)
                                    if usage[1]:
                                        tokens = usage
                            yield joined
                            if tracker.done:
                                break
                    if tracker.done:
                        self.breakers.success(worker.id)
                        return
                    if tracker.finished:  # a finish_reason came, only [DONE] is missing
                        yield b"data: [DONE]\n\n"
                        return
                    raise _StreamBroke("the engine closed the stream before it finished")
                except (aiohttp.ClientError, TimeoutError, _StreamBroke, WorkerWentAway) as exc:
                    reason = "stalled" if isinstance(exc, TimeoutError) else type(exc).__name__
                    self.breakers.failure(worker.id, f"stream {reason}")
                    resp.close()
                    attempt.release(worker.id)
                    counted = False
                    tracker.analyse()
                    log.warning("gateway.stream_broke", worker=worker.id, reason=reason,
                                sent_chunks=tracker.content_chunks, request_id=fields["request_id"])
                    if not tracker.resumable or resumes >= settings.max_resumes:
                        outcome = f"broken:{reason}"
                        yield tracker.error_event("The engine serving this stream failed and the stream cannot be "
                                                  f"resumed elsewhere{tracker.why_not}; the answer is incomplete.")
                        return
                    assert isinstance(tracker, StreamTracker)  # the only resumable kind
                    plan = continuation(attempt.body, attempt.kind, tracker.text, tracker.content_chunks,
                                        continues_trailing_assistant(worker.info))
                    if plan is None:
                        yield tracker.final_length_chunk()
                        return
                    resumes += 1
                    try:  # shaped for whichever engine takes over, by what its worker declares
                        choice, resp = await attempt.resume(shaped(plan.body))
                    except GatewayError as err:
                        outcome = f"broken:{reason}"
                        yield tracker.error_event(f"The stream could not be resumed on another worker: {err.message}")
                        return
                    worker = choice.worker
                    counted = True
                    self.metrics.resumed_stream(str(fields["model"]))
                    tracker.start_segment()
                    log.info("gateway.stream_resumed", worker=worker.id, resumes=resumes,
                             sent_chunks=tracker.content_chunks, request_id=fields["request_id"])
        except BaseException:
            # The client went away (cancellation) or the server is stopping: abort the
            # engine's request by closing its connection instead of reading it to the end.
            outcome = "client_gone"
            raise
        finally:
            if counted:
                if outcome == "completed":
                    resp.release()
                else:
                    resp.close()
                attempt.release(worker.id)
            elapsed = time.perf_counter() - started
            tokens = tokens if tokens[1] else tracker.hidden_usage
            self.metrics.request_done(
                str(fields["model"]), worker.id, 200, True, elapsed,
                first_chunk_ms / 1000 if first_chunk_ms is not None else None, *tokens,
            )
            log.info(
                "gateway.request", **fields, final_worker=worker.id, status=200, outcome=outcome,
                resumes=resumes, ttft_ms=first_chunk_ms, ms=round(elapsed * 1000, 2),
                prompt_tokens=tokens[0], completion_tokens=tokens[1],
            )


# (choice, open streaming response or None, (status, body) when not streaming)
_Result = tuple[Choice, aiohttp.ClientResponse | None, tuple[int, bytes]]


class _Attempt:
    """The attempts at one request: each picks the best worker not tried yet."""

    def __init__(
        self, proxy: Proxy, path: str, kind: str, body: bytes, stream: bool, facts: RequestFacts, floor: int
    ) -> None:
        self.proxy = proxy
        self.path = path
        self.kind = kind
        self.body = body
        self.stream = stream
        self.facts = facts
        # The fewest tokens the prompt can have (equal to the estimate with a tokenizer).
        self.floor = floor
        # Each attempt decides afresh (the fleet may have changed), skipping these.
        self.tried: list[str] = []
        self.count = 0
        self.last_error: GatewayError | None = None
        self.queue_deadline: float | None = None
        # Held once for its worker's KV room (`Proxy._hold`); never twice.
        self.held = False
        self.replaced = False
        # The KV tokens this request holds on its worker by the gateway's account: its own
        # prompt tokens and completion budget, and the prefix it shares with its key's others.
        self.prefix = facts.prefix_tokens
        self.own_tokens = max(0, facts.prompt_tokens - self.prefix) + (
            facts.max_tokens or _DEFAULT_COMPLETION_TOKENS)
        self.key = facts.affinity_key
        self.headers = _FORWARD_HEADERS

    def hold(self, worker_id: str) -> None:
        self.proxy.inflight.add(worker_id, self.own_tokens, self.key, self.prefix)
        if self.facts.adapter:  # never evicted while in flight; a busy adapter gets a replica
            self.proxy.placer.started(worker_id, self.facts.model)

    def release(self, worker_id: str) -> None:
        self.proxy.inflight.done(worker_id, self.own_tokens, self.key, self.prefix)
        if self.facts.adapter:
            self.proxy.placer.finished(worker_id, self.facts.model)

    def first_byte_timeout(self) -> float:
        s = self.proxy.settings
        return s.first_byte_timeout_s + s.first_byte_per_1k_tokens_s * self.facts.prompt_tokens / 1000

    def answer_timeout(self, worker: WorkerView) -> float:
        """A whole non-streamed answer: its first byte's time, plus time for every token asked
        for (without max_tokens, for what the worker's context leaves)."""
        facts = self.facts
        tokens = facts.max_tokens or max(_DEFAULT_COMPLETION_TOKENS, worker.info.max_model_len - facts.prompt_tokens)
        return self.first_byte_timeout() + self.proxy.settings.answer_per_token_s * tokens

    def saturated(self) -> str | None:
        """The limit every eligible worker is at ("slots", "kv"), or None when one has room."""
        proxy = self.proxy
        decision = decide(proxy.watcher.snapshot.routes, self.facts, proxy.live, proxy.policy,
                          self.tried, limit=1, full_at=proxy.settings.full_at)
        return decision.why or "slots" if decision.verdict == "saturated" else None

    async def next(self, body: Callable[[WorkerView], bytes] | None = None) -> _Result:
        """Send the request (or `body(worker)`, shaped for the chosen worker) to the best worker left."""
        proxy = self.proxy
        if self.key is not None and self.count == 0:
            # Looked up now, not when the request arrived: it may have waited in the queue.
            home, second, heavy = proxy.placement.lookup(self.key)
            if home != self.facts.home or second != self.facts.second or heavy != self.facts.heavy:
                self.facts = replace(self.facts, home=home, second=second, heavy=heavy)
        choice = self._choose()
        worker = choice.worker
        if self.count == 0:
            proxy.placement.record(self.facts, choice, self.own_tokens)
        self.tried.append(worker.id)
        self.count += 1
        self.hold(worker.id)
        url = worker.info.url + self.path
        try:
            with proxy.waits.waiting(worker.id):
                resp = await proxy.upstream.post(url, body(worker) if body else self.body, self.headers, self.stream,
                                                 self.first_byte_timeout() if self.stream else self.answer_timeout(worker))
        except UpstreamError as exc:
            self.release(worker.id)
            self._failed(worker, exc)
        except BaseException:  # cancelled: the client hung up, the engine's request is closed
            self.release(worker.id)
            raise
        if self.stream and resp.status == 200:
            return choice, resp, (200, b"")
        try:
            with proxy.waits.waiting(worker.id):
                data = await proxy.upstream.read(resp)
        except UpstreamError as exc:
            self._failed(worker, exc)
        finally:
            resp.release()
            self.release(worker.id)
        if resp.status == 429:  # full, not sick: retried elsewhere, never held against it
            self._failed(worker, Overloaded(f"Worker {worker.id} is at capacity.", retry_after=1), sick=False)
        if resp.status in RETRYABLE_STATUS:
            message = openai_error_body(resp.status, data).decode()
            self._failed(worker, UpstreamError(f"engine {worker.id} answered {resp.status}: {message[:300]}"))
        if resp.status < 400:  # the client's 4xx says nothing of the engine's health
            proxy.breakers.success(worker.id)
        if resp.status >= 400:
            data = openai_error_body(resp.status, data)
            if (tokens := refused_prompt_tokens(resp.status, data)) is not None:
                self._refused(worker, tokens, data)
        return choice, None, (resp.status, data)

    def _refused(self, worker: WorkerView, tokens: int, data: bytes) -> None:
        """The engine's context is too small for the prompt: try a roomier worker, if any."""
        facts = refit(self.facts, self.proxy.watcher.snapshot.routes, self.tried, tokens)
        if facts is None:
            return
        self.facts, self.floor = facts, tokens
        log.info("gateway.context_refused", worker=worker.id, prompt_tokens=tokens,
                 max_model_len=worker.info.max_model_len)
        self.last_error = ContextLengthExceeded(error_message(data), param="messages")
        raise _Retryable(self.last_error)

    async def resume(self, body: Callable[[WorkerView], bytes]) -> tuple[Choice, aiohttp.ClientResponse]:
        """Start the continuation of a broken stream on another worker (retried like a request)."""
        for _ in range(self.proxy.settings.retry_attempts):
            try:
                choice, resp, _ = await self.next(body)
            except _Retryable:
                continue
            if resp is not None:
                return choice, resp
            raise UpstreamError("the engine refused the continuation")
        raise self.last_error or NoWorkerAvailable("No other worker can continue this stream.")

    def _choose(self) -> Choice:
        proxy = self.proxy
        routes = proxy.watcher.snapshot.routes
        # Shed load on a request's first attempt only: a retry or a resume has waited enough.
        full_at = proxy.settings.full_at if self.count == 0 else None
        decision = decide(routes, self.facts, proxy.live, proxy.policy, self.tried, limit=1,
                          full_at=full_at)
        if decision.verdict == "saturated":
            raise _Saturated
        if full_at is not None and not self.held and decision.choices and full_at.holds(
                decision.choices[0].slot, proxy.live, self.own_tokens):
            raise _Held(decision.choices[0].slot)
        if decision.verdict == "context_length" and self.floor + (self.facts.max_tokens or 0) < decision.limit:
            # Only an estimate says it does not fit: let the roomiest workers' engines decide.
            roomiest = replace(self.facts, prompt_tokens=decision.limit - 1, max_tokens=None)
            decision = decide(routes, roomiest, proxy.live, proxy.policy, self.tried, limit=1)
        if decision.choices:
            return decision.choices[0]
        if decision.verdict == "unknown_model":
            raise ModelNotFound(
                f"The model `{self.facts.model}` does not exist or no worker serves it.", param="model"
            )
        if decision.verdict == "wrong_task":
            if self.facts.pooling:
                raise InvalidRequest(f"`{self.facts.model}` generates text; it does not serve embeddings. "
                                     "Name an embedding model.", param="model", code="model_not_supported")
            raise InvalidRequest(f"`{self.facts.model}` is an embedding model: it serves /v1/embeddings, not "
                                 f"{self.path}.", param="model", code="model_not_supported")
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
            f"No worker can serve `{self.facts.model}` right now (all draining or unhealthy); "
            "try again shortly.",
            retry_after=1,
        )

    def _failed(self, worker: WorkerView, error: GatewayError, sick: bool = True) -> NoReturn:
        self.last_error = error
        if sick:
            self.proxy.breakers.failure(worker.id, error.message)
        log.warning("gateway.attempt_failed", worker=worker.id, attempt=self.count, error=error.message)
        raise _Retryable(error)


__all__ = ["Proxy", "Reply"]
