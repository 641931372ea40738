"""The attempts at one request: choose a worker, send, and on a safe failure choose again.

`Attempt.until_answered` drives them: `next` sends the request to the best worker not tried
yet (`_sent` talks to the engine, `_judged` reads its whole answer) and says by what it raises
why it did not (`Saturated`, `Held`, `SlotHeld`, `Retryable`: gateway/request/dispatch.py);
`until_answered` answers each by calling down, to the gateway's queue and holds or to the one
retry policy (gateway/request/retries.py), and tries again. A broken stream's continuation is
`resume`.
An attempt sees only `Dispatch`, the few collaborators a send needs, never the whole proxy.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, NoReturn

import structlog
from msgspec.structs import replace
from tenacity import RetryCallState

from fleetgate.schema import WorkerView
from gateway.accounts.priorities import Priority
from gateway.accounts.waiting import engine_queued
from gateway.engines.upstream import (
    RETRYABLE_STATUS,
    Patience,
    Response,
    openai_error_body,
)
from gateway.errors import (
    ContextLengthExceeded,
    EngineUnreachable,
    GatewayError,
    ModelNotFound,
    NoWorkerAvailable,
    Overloaded,
    UpstreamError,
    detail,
)
from gateway.observe.metrics import answer_usage
from gateway.observe.tracing import NO_TRACE, RequestTrace
from gateway.request import retries
from gateway.request.context import Refusal, no_worker, refusal
from gateway.request.dispatch import (
    FORWARD_HEADERS,
    Dispatch,
    Held,
    Result,
    Retryable,
    Saturated,
    SlotHeld,
)
from gateway.request.retries import DEFAULT_COMPLETION_TOKENS
from gateway.routing import Choice, Decision, RequestFacts, decide
from gateway.routing.lora_gate import Gate
from gateway.routing.table import REPORT_GROWTH_TOKENS, Slot

log = structlog.get_logger("gateway.attempts")

_DEFAULT_PRIORITY = Priority("default")


class Attempt:
    """The attempts at one request: each picks the best worker not tried yet."""

    def __init__(
        self, dispatch: Dispatch, path: str, kind: str, body: bytes, stream: bool, facts: RequestFacts, floor: int,
        request_id: str, trace: RequestTrace = NO_TRACE, priority: Priority = _DEFAULT_PRIORITY, tenant: str = "",
        falls_back: bool = False, task: asyncio.Task[Any] | None = None,
    ) -> None:
        self.dispatch = dispatch
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
        self.unreachable = 0  # attempts that found no engine to talk to
        self.queue_deadline: float | None = None
        # Held once for its worker's KV room (`retries.wait_out`); never twice.
        self.held = False
        self.replaced = False
        # Adapter requests: when it arrived (its slot wait is bounded from then: gateway/request/retries.py),
        # and whether it waited for a LoRA slot ("slot-held", "slot-timeout": its route says so).
        self.arrived = time.monotonic() if facts.adapter else 0.0
        self.slot_held = ""
        self.slot_for = ""  # the worker whose slot its hold got
        # The KV tokens this request holds on its worker by the gateway's account: its own
        # prompt tokens and completion budget, and the prefix it shares with its key's others.
        self.prefix = facts.prefix_tokens
        own_prompt = max(0, facts.prompt_tokens - self.prefix)
        budget = facts.max_tokens or DEFAULT_COMPLETION_TOKENS
        self.own_tokens = own_prompt + budget
        # What it adds before its engine's next report, where the engine measures its KV use.
        self.fresh = own_prompt + min(budget, REPORT_GROWTH_TOKENS)
        # The work it adds to its affinity key's placement: its prompt and what a completion
        # typically takes (a budget of thousands is an upper bound, not a prediction).
        self.work = own_prompt + min(budget, DEFAULT_COMPLETION_TOKENS)
        self.key = facts.affinity_key
        # What its prefix is shared under on a worker (gateway/accounts/inflight.py).
        self.share_key = facts.prefix_key if facts.prefix_key is not None else facts.affinity_key
        # What the engine is sent beside the body: its request id, the trace's context.
        self.headers = {**FORWARD_HEADERS, "x-request-id": request_id, **trace.forward}
        self.trace = trace
        # Its priority class (gateway/accounts/priorities.py), the key it is queued fairly among
        # ("": all one line), and when a worker counts full for it (its class's share).
        self.priority = priority
        self.tenant = tenant
        self.full_at = priority.full_at(dispatch.full_at)
        # The request has a fallback model (gateway/models/aliases.py): when this one is full or its
        # context too small, raise at once (no queueing, no engine 400) so the fallback gets it.
        self.falls_back = falls_back
        # A stream's prefill, counted on its worker until its first token (`prefilled`): the
        # worker, and the prompt tokens its engine did not hold when it was sent.
        self.prefilling: str | None = None
        self.unprefilled = 0
        # The last whole 200 answer's (prompt, completion) tokens (`_sent`); None: none read.
        self.usage: tuple[int, int] | None = None
        self.task = task  # serving the request, where known (its first-byte waits name it); None: looked up

    def kv_tokens(self, slot: Slot) -> int:
        """The KV tokens this request counts for on `slot` when deciding whether it fits: until
        the next report where its engine measures KV use, else its whole account."""
        return self.fresh if slot.measured else self.own_tokens

    def hold(self, worker_id: str) -> None:
        inflight = self.dispatch.inflight
        inflight.add(worker_id, self.own_tokens, self.share_key, self.prefix, self.fresh)
        if self.stream and (prompt := self.facts.prompt_tokens):
            # Only a stream says when its prefill ended (its first event).
            n = prompt - self.facts.cached.get(worker_id, 0)
            self.unprefilled = n if n > 1 else 1
            self.prefilling = worker_id
            inflight.pend(worker_id, self.unprefilled)
        if self.facts.adapter:  # never evicted while in flight; a busy adapter gets a replica
            self.dispatch.placer.started(worker_id, self.facts.model)

    def prefilled(self) -> None:
        """The stream's first event came: its engine has prefilled its prompt."""
        if self.prefilling is not None:
            self.dispatch.inflight.pend(self.prefilling, -self.unprefilled)
            self.prefilling = None

    def release(self, worker_id: str) -> None:
        if self.prefilling == worker_id:
            self.prefilled()
        self.dispatch.inflight.done(worker_id, self.own_tokens, self.share_key, self.prefix, self.fresh)
        if self.facts.adapter:
            self.dispatch.placer.finished(worker_id, self.facts.model)

    def candidates(self) -> list[str]:
        """The model's routable workers not tried before the newest attempt (for its trace)."""
        routes = self.dispatch.watcher.snapshot.routes.by_model.get(self.facts.model)
        before = self.tried[:-1]  # `tried` already holds the newest attempt's worker
        return [s.id for s in routes.routable if s.id not in before] if routes is not None else self.tried[-1:]

    def first_byte_timeout(self) -> float:
        s = self.dispatch.settings
        return s.first_byte_timeout_s + s.first_byte_per_1k_tokens_s * self.facts.prompt_tokens / 1000

    def answer_timeout(self, worker: WorkerView) -> float:
        """A whole non-streamed answer: its first byte's time, plus time for every token asked
        for (without max_tokens, for what the worker's context leaves)."""
        facts = self.facts
        tokens = facts.max_tokens or max(DEFAULT_COMPLETION_TOKENS, worker.info.max_model_len - facts.prompt_tokens)
        return self.first_byte_timeout() + self.dispatch.settings.answer_per_token_s * tokens

    def saturated(self) -> str | None:
        """The limit every eligible worker is at ("slots", "kv"), or None when one has room."""
        dispatch = self.dispatch
        decision = decide(dispatch.watcher.snapshot.routes, self.facts, dispatch.live, dispatch.policy,
                          self.tried, limit=1, full_at=self.full_at)
        return decision.why or "slots" if decision.verdict == "saturated" else None

    async def until_answered(self) -> Result:
        """Attempt until a worker answers: re-place an evicted adapter once, wait out a full
        fleet, a full KV cache or busy LoRA slots, retry a failure that reached no client byte."""
        dispatch, model = self.dispatch, self.facts.model
        placer, settings = dispatch.placer, dispatch.settings
        if self.facts.adapter and placer.known(model):
            await placer.ensure(model)
        while True:
            try:
                return await self.next()
            except Retryable as failure:
                if settings.retry_attempts <= 1:
                    raise failure.final from None
                return await retries.tries(self.next, settings, settings.retry_attempts - 1, self._retrying)
            except (Saturated, Held, SlotHeld) as why:
                await retries.wait_out(why, self)
            except ModelNotFound:
                if not (self.facts.adapter and placer.known(model)) or self.replaced:
                    raise
                self.replaced = True  # evicted between its placement and now: place it again
                await placer.ensure(model)

    async def resume(self, body: Callable[[WorkerView], bytes]) -> tuple[Choice, Response]:
        """Start the continuation of a broken stream on another worker, retried as a request is."""
        settings = self.dispatch.settings
        return await retries.tries(lambda: self._continued(body), settings, settings.retry_attempts)

    async def _continued(self, body: Callable[[WorkerView], bytes]) -> tuple[Choice, Response]:
        choice, resp, _ = await self.next(body)
        if resp is None:  # not retried: only a `Retryable` is
            raise UpstreamError("the engine refused the continuation")
        return choice, resp

    def _retrying(self, _: RetryCallState) -> None:
        """Before each retry: its series, its trace event and its log line."""
        self.dispatch.metrics.retry(self.facts.model)
        why = detail(self.last_error) if self.last_error else ""
        self.trace.retry(self.count + 1, why)
        log.info("gateway.retry", model=self.facts.model, attempt=self.count + 1, error=why)

    async def next(self, body: Callable[[WorkerView], bytes] | None = None) -> Result:
        """Send the request (or `body(worker)`, shaped for the chosen worker) to the best worker left."""
        dispatch = self.dispatch
        if self.key is not None and self.count == 0:
            self._placed()
        choice = self._choose()
        worker = choice.worker
        if self.count == 0:
            dispatch.placement.record(self.facts, choice, self.work)
        self.tried.append(worker.id)
        self.count += 1
        self.hold(worker.id)
        failed: GatewayError | None = None
        try:
            resp, data, refused = await self._sent(worker, choice, body(worker) if body else self.body)
        except UpstreamError as exc:
            failed = exc
        except BaseException:  # cancelled: the client hung up, the engine's request is closed
            self.release(worker.id)
            raise
        if failed is None and self.stream and resp.status == 200:
            return choice, resp, (200, b"")  # the relay holds the worker from here
        self.release(worker.id)
        if failed is None:
            failed = self._judged(worker, resp.status, data, refused)
        if failed is not None:
            self._failed(worker, failed)
        if resp.status < 400:  # the client's 4xx says nothing of the engine's health
            dispatch.breakers.success(worker.id)
        self.trace.attempt_end()
        return choice, None, (resp.status, data)

    async def _sent(self, worker: WorkerView, choice: Choice, body: bytes) -> tuple[Response, bytes, Refusal | None]:
        """The engine's answer to `body`: a stream's head, or a whole answer read whole (an error
        in OpenAI's shape, a context refusal with it); raises UpstreamError for no answer."""
        dispatch = self.dispatch
        url = worker.info.url + self.path
        first = self.first_byte_timeout()
        limit = first if self.stream else self.answer_timeout(worker)
        headers = self.trace.attempt(self.headers, choice, url, dispatch.policy.name, self.candidates)
        # One wait for the first byte: a stream's head, or a whole answer's head and body.
        with dispatch.waits.waiting(worker.id, self.task):
            if self.stream:
                resp = await dispatch.upstream.post(url, body, headers, True, first)
            else:
                # Queued in its engine, a whole answer may wait as long as a stream's first event:
                # its head's wait is cut at `limit` unless its engine then reports requests
                # waiting, and so on up to `most`.
                most = limit + max(0.0, dispatch.settings.first_byte_queued_timeout_s - first)
                patience = Patience(asyncio.get_running_loop().time(), limit, most, lambda: engine_queued(
                    dispatch.watcher.snapshot.by_id.get(worker.id))) if most > limit else None
                resp = await dispatch.upstream.post(url, body, headers, False, most, patience)
                resp.timeout = limit  # the body, once the answer came, reads as before
            self.trace.attempt_status(resp.status)
            if self.stream and resp.status == 200:
                return resp, b"", None
            data = await dispatch.upstream.body_of(resp)
        status = resp.status
        # A 200's usage is read in the pass that checks it is JSON (`usage`: None until then).
        self.usage = answer_usage(data) if status == 200 else None
        if status == 200 and self.usage is None:  # never relayed: it may name the engine
            raise UpstreamError("The engine's answer was not valid JSON.", detail=(
                f"engine at {url} answered 200 with {resp.content_type or 'no content type'} that is not "
                f"a JSON object: {data[:120]!r}"))
        if status < 400:
            return resp, data, None
        data = openai_error_body(status, data)  # the engine's error, in OpenAI's shape
        refused = refusal(status, data, self.facts, dispatch.watcher.snapshot.routes, self.tried) if status == 400 else None
        return resp, data, refused

    def _placed(self) -> None:
        """Where the key is placed: looked up now, not on arrival (the request may have queued)."""
        home, second, heavy = self.dispatch.placement.lookup(self.key)
        if home != self.facts.home or second != self.facts.second or heavy != self.facts.heavy:
            self.facts = replace(self.facts, home=home, second=second, heavy=heavy)

    def _judged(self, worker: WorkerView, status: int, data: bytes, refused: Refusal | None) -> GatewayError | None:
        """Why another worker may answer better than this whole answer (None: it stands)."""
        if status == 429:  # full, not sick: retried elsewhere, never held against it
            return Overloaded(f"Worker {worker.id} is at capacity.", retry_after=1)
        if status in RETRYABLE_STATUS:
            # The engine's own message stays in the log: it may name the engine's address.
            return UpstreamError(f"The engine answered {status}.",
                                 detail=f"engine {worker.id} answered {status}: {data.decode()[:300]}")
        if refused is None:
            return None
        # The engine's context is too small for the prompt: try a roomier worker, if any.
        if refused.facts is None:
            if self.falls_back:
                raise ContextLengthExceeded(refused.message, param="messages")
            return None
        self.facts, self.floor = refused.facts, refused.tokens
        log.info("gateway.context_refused", worker=worker.id, prompt_tokens=refused.tokens,
                 max_model_len=worker.info.max_model_len)
        return ContextLengthExceeded(refused.message, param="messages")

    def _choose(self) -> Choice:
        dispatch = self.dispatch
        routes = dispatch.watcher.snapshot.routes
        # Shed load on a request's first attempt only: a retry or a resume has waited enough.
        full_at = self.full_at if self.count == 0 else None
        decision = decide(routes, self.facts, dispatch.live, dispatch.policy, self.tried, limit=1,
                          full_at=full_at)
        if decision.verdict == "saturated":
            raise Saturated
        if full_at is not None and not self.held and decision.choices:
            slot = decision.choices[0].slot
            tokens = self.kv_tokens(slot)
            if full_at.holds(slot, dispatch.live, tokens):
                raise Held(slot, tokens)
        if self.facts.adapter and decision.choices:
            choice = decision.choices[0]
            if (why := self._slot_gate(choice.slot)) and (steered := self._steer(choice)) is not choice:
                choice, why = steered, self._slot_gate(steered.slot)
            if why:
                raise SlotHeld(choice.slot, why)
            # The decision log and the route header say it waited for a slot.
            return Choice(choice.slot, f"{choice.reason}+{self.slot_held}") if self.slot_held else choice
        if decision.verdict == "context_length" and self.floor + (self.facts.max_tokens or 0) < decision.limit:
            # Only an estimate says it does not fit: let the roomiest workers' engines decide.
            roomiest = replace(self.facts, prompt_tokens=decision.limit - 1, max_tokens=None)
            decision = decide(routes, roomiest, dispatch.live, dispatch.policy, self.tried, limit=1)
        if decision.choices:
            return decision.choices[0]
        raise self._refusal(decision)

    def _slot_gate(self, slot: Slot) -> Gate | None:
        """Why this adapter request waits before going to `slot` (None: it goes): only while
        its slot wait has time left (`lora_slot_wait_max_s` from its arrival; 0: never)."""
        settings = self.dispatch.settings
        if settings.lora_slot_wait_max_s <= 0 or time.monotonic() - self.arrived >= settings.lora_slot_wait_max_s:
            return None
        return self.dispatch.placer.state.gate(slot, self.facts.model, self.arrived, settings.lora_slot_turn_s)

    def _steer(self, choice: Choice) -> Choice:
        """Where an adapter request goes when the gate would hold it at the policy's choice: the
        worker its hold got a slot on, else where this gateway holds requests for the adapter
        (it joins their line rather than take a second engine's slot); else the choice."""
        state, model = self.dispatch.placer.state, self.facts.model
        target = self.slot_for or state.held_on(model)
        if not target or target == choice.slot.id:
            return choice
        routes = self.dispatch.watcher.snapshot.routes.by_model.get(model)
        slot = next((s for s in routes.routable if s.id == target), None) if routes is not None else None
        if slot is None or target in self.tried:
            return choice
        return Choice(slot, "adapter-held")

    def _refusal(self, decision: Decision) -> GatewayError:
        """Why no worker can take the request, for the client."""
        return no_worker(decision, self.facts, self.floor, self.path) or self.final_error() or NoWorkerAvailable(
            f"No worker can serve `{self.facts.model}` right now (all draining or unhealthy); try again shortly.",
            retry_after=1)

    def final_error(self) -> GatewayError | None:
        """What the client gets when the attempts end: the last one's error, unless no worker
        tried could even be reached (killed, its record not yet expired): then a 503 to retry,
        since the fleet is changing, that names no engine's address."""
        error = self.last_error
        if isinstance(error, EngineUnreachable) and self.unreachable == self.count:
            return NoWorkerAvailable(
                f"No worker of `{self.facts.model}` could be reached ({self.count} tried); the fleet "
                "is changing, try again shortly.", code="workers_unreachable", retry_after=1)
        return error

    def _failed(self, worker: WorkerView, error: GatewayError) -> NoReturn:
        """Try another worker: the engine failed (held against it, but for a 429: full, not
        sick), or refused a prompt too long for its context (a roomier one is left)."""
        self.last_error = error
        self.unreachable += isinstance(error, EngineUnreachable)
        failure = Retryable(error, self.final_error() or error)
        if not isinstance(error, ContextLengthExceeded):  # the engine was well, only too small
            why = detail(error)  # the engine's address too: for the log, the circuit, the trace
            self.trace.attempt_end(why)
            if not isinstance(error, Overloaded):
                self.dispatch.breakers.failure(worker.id, why)
            log.warning("gateway.attempt_failed", worker=worker.id, attempt=self.count, error=why)
        raise failure
