"""Proxying one OpenAI request: parse the little routing needs, pick a worker, forward, relay.

Three rooms: this one turns the request into routing facts and writes its outcome;
gateway/request/attempts.py's `Attempt.until_answered` chooses workers and sends, calling down to the
queue, the holds and the retry policy (gateway/request/retries.py); gateway/request/relay.py
relays a stream and continues it elsewhere when it breaks (`Attempt.resume`).

The body goes to the engine byte for byte. Only the fields routing needs are
decoded. A failure before any byte reached the client (refused connection,
timeout, engine 5xx/429, a body cut short) is retried on another worker, bounded
in attempts and in time, with jittered backoff and one log event per retry. Once a
stream has started, events are relayed as they arrive; if the engine dies or
stalls mid-stream, the stream is continued on another worker (gateway/request/resume.py).
When every eligible worker is full by the gateway's own account, the request waits in a
bounded FIFO queue woken by completions (gateway/accounts/admission.py), then gets 429 +
Retry-After. A client that goes away closes the engine's request (gateway/front/front.py).
The engine gets the request's `x-request-id`; a stream always asks it for usage.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

from fleetgate.schema import WorkerView
from gateway.accounts.adapters import AdapterPlacer
from gateway.accounts.admission import Admission
from gateway.accounts.circuit import Breakers
from gateway.accounts.inflight import SharedInflight
from gateway.accounts.placement import Placement
from gateway.accounts.priorities import HEADER as PRIORITY_HEADER
from gateway.accounts.priorities import Priorities, Priority
from gateway.accounts.waiting import FirstByteWaits
from gateway.engines.upstream import Upstream
from gateway.errors import GatewayError, InvalidRequest
from gateway.fleet import FleetWatcher
from gateway.models.aliases import Route, fallback_reason, resolve, with_model
from gateway.models.live_routes import Routes
from gateway.observe import outcomes
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.tracing import RequestTrace, Tracing
from gateway.request.attempts import Attempt
from gateway.request.dispatch import Dispatch, Result
from gateway.request.prefix_cache import PrefixCache
from gateway.request.relay import relay
from gateway.request.reply import Answered, Reply, unanswered
from gateway.request.requests import (
    GENERATES,
    Probe,
    affinity,
    parse_request,
    prompt_tokens,
    shared_prefix,
)
from gateway.request.responses import (
    ResponsesTracker,
    forward_stored,
    owner_of,
    remember,
    response_id_of,
)
from gateway.request.resume import StreamTracker, unresumable, with_usage
from gateway.request.tokenizers import Tokenizers
from gateway.routing import Live, Policy, RequestFacts
from gateway.settings import GatewaySettings
from gateway.tenants.quota import Quota, Ticket
from gateway.tenants.tenants import Tenant

log = structlog.get_logger("gateway.proxy")


# Plain classes, not dataclasses: compiled, a dataclass's generated __init__ runs as Python.
class _Request:
    """One request as `Proxy._serve` took it in, what each model of its plan is sent with.
    `named`: the model its body names; `owner`: the worker storing the response it continues;
    `task`: the task serving it, where known."""

    def __init__(self, named: str, path: str, kind: str, session: str | None, key_id: str, request_id: str,
                 started: float, trace: RequestTrace, priority: Priority, tenant: Tenant | None,
                 owner: WorkerView | None, task: asyncio.Task[Any] | None = None) -> None:
        self.named, self.path, self.kind, self.session = named, path, kind, session
        self.key_id, self.request_id, self.started, self.trace = key_id, request_id, started, trace
        self.priority, self.tenant, self.owner, self.task = priority, tenant, owner, task


# What answered: the model's request, its attempts (their body as sent) and their result, the
# key's ticket, and whether it fell back.
_Sent = tuple[Probe, Attempt, Result, "Ticket | None", bool]


# Named functions, not lambdas: mypyc compiles this module (scripts/compile.py) and
# does not take a lambda in a dataclass's methods or field defaults.
def _new_prefix() -> str:
    return uuid.uuid4().hex[:16]


def _hides_usage(probe: Probe, kind: str) -> bool:
    """Whether the client's stream goes without the usage chunk (the engine is asked for it)."""
    return probe.stream and kind in ("chat", "completion") and not probe.wants_usage


def _constant(routes: Routes) -> Callable[[], Routes]:
    def get() -> Routes:
        return routes
    return get


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
    tracing: Tracing = field(default_factory=Tracing)
    # The engines' prefix caches by their KV cache events; None: route by the placement only.
    prefix_cache: PrefixCache | None = None
    # Priority classes (gateway/accounts/priorities.py); None: from the settings.
    priorities: Priorities | None = None
    # Per-key limits and usage (gateway/tenants/quota.py); None: keys carry no limits.
    quota: Quota | None = None
    # The effective aliases and fallbacks; None: the settings' (create_app gives the live ones).
    routes: Callable[[], Routes] = None  # type: ignore[assignment]
    seq: int = 0
    live: Live = field(init=False)
    waits: FirstByteWaits = field(init=False)
    dispatch: Dispatch = field(init=False)
    classes: Priorities = field(init=False)

    def __post_init__(self) -> None:
        self.classes = self.priorities or Priorities.from_settings(self.settings)
        if self.routes is None:
            static = Routes(self.settings.aliases, self.settings.fallbacks)
            self.routes = _constant(static)
        self.waits = FirstByteWaits(self.watcher.current)
        self.live = self.placement.live(Live(self.inflight.total, self.inflight.total_tokens,
                                            fresh=self.inflight.total_fresh, pending=self.inflight.total_pending))
        self.watcher.on_refresh(self.inflight.reported)
        self.inflight.on_done = self.admission.wake
        self.dispatch = Dispatch(self.settings, self.watcher, self.upstream, self.policy, self.live, self.inflight,
                                 self.placer, self.placement, self.breakers, self.waits, self.settings.full_at,
                                 self.admission, self.metrics)
    # Request ids: a random per-process prefix and a counter (no syscall per request).
    _id_prefix: str = field(default_factory=_new_prefix)

    def _next_id(self) -> str:
        return f"{self._id_prefix}{self.seq:016x}"

    async def serve(
        self, body: bytes, header: Callable[[str], str | None], path: str, kind: str, key_id: str = "",
        tenant: Tenant | None = None, task: asyncio.Task[Any] | None = None,
    ) -> Reply:
        """Route and forward one OpenAI request. `header(name)` reads a request header; `task`:
        the task serving it, where the caller knows it (else looked up where needed).

        Raises GatewayError (with its `request_id` set) for every answer the gateway
        gives itself; engine answers, errors included, come back as a Reply.
        """
        started = time.perf_counter()
        self.seq += 1
        request_id = header("x-request-id") or self._next_id()
        trace = self.tracing.start(header, path, request_id)
        try:
            reply = await self._serve(body, header, path, kind, key_id, request_id, started, trace, tenant, task)
        except GatewayError as exc:
            trace.end(exc.status, error=exc.code)
            if exc.request_id is None:  # refused before routing (a bad body): not logged yet
                exc.request_id = request_id
                outcomes.failed(self.metrics, exc, started, request_id=request_id, key_id=key_id)
            raise
        except asyncio.CancelledError:  # the client hung up, or the server stops
            trace.end(outcomes.CLIENT_GONE, "client_gone")
            raise
        except Exception:
            trace.end(500, error="internal_error")
            raise
        if reply.stream is None and reply.after is None:  # a stream's trace ends with it (gateway/request/relay.py)
            trace.end(reply.status)
        return reply

    async def _serve(
        self, body: bytes, header: Callable[[str], str | None], path: str, kind: str, key_id: str,
        request_id: str, started: float, trace: RequestTrace, tenant: Tenant | None = None,
        task: asyncio.Task[Any] | None = None,
    ) -> Reply:
        probe = parse_request(body, kind)
        trace.described(probe.model, probe.stream)
        priority = self.classes.priority_of(key_id, header(PRIORITY_HEADER))
        session = header("x-session-id") or probe.user
        # The alias's model for this session (else request), then its fallbacks (gateway/models/aliases.py).
        routes = self.routes()  # live: the YAML's overlaid by the admin API's (gateway/models/live_routes.py)
        plan = resolve(routes.aliases, routes.fallbacks, probe.model, session or request_id)
        # A follow-up's stored response pins its worker; looked up only then (Redis).
        owner = None if probe.previous_response_id is None else await owner_of(
            self.watcher, probe.previous_response_id, "previous_response_id")
        req = _Request(probe.model, path, kind, session, key_id, request_id, started, trace, priority, tenant, owner,
                       task)
        probe, attempt, (choice, resp, data), ticket, fell_back = await self._send(probe, body, req, plan)
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
            ("x-fleetgate-model", probe.model),
            *((("x-fleetgate-alias", plan.alias),) if plan.alias else ()),
            *(ticket.headers if ticket is not None else ()),
        ]
        if self.classes.enabled:
            headers.append((PRIORITY_HEADER, priority.name))
        fields = {
            "request_id": request_id, "key_id": key_id, "model": probe.model, "adapter": attempt.facts.adapter,
            "worker": worker.id, "route": choice.reason, "attempts": attempt.count, "stream": probe.stream,
            "alias": plan.alias, "fallback_from": plan.models[0] if fell_back else None,
            "kv_held": attempt.held,
        }
        stores = kind == "responses" and probe.store is not False
        if resp is not None:
            body = attempt.body  # as sent
            tracker: StreamTracker | ResponsesTracker = (
                ResponsesTracker() if kind == "responses"
                else StreamTracker(kind, lambda text_sent: unresumable(body, kind, text_sent), _hides_usage(probe, kind))
            )
            return Reply(200, headers, stream=relay(attempt, choice, resp, tracker, self.metrics, started, fields,
                                                    stores, ticket))
        status, payload = data
        if stores and status == 200 and (response_id := response_id_of(payload)):
            await remember(self.watcher, response_id, worker.id, self.settings.responses_ttl_s)
        done = Answered(self.metrics, ticket, probe.model, worker.id, status, time.perf_counter() - started,
                         payload, fields, trace, attempt.usage if status == 200 else None)
        if ticket is not None and not ticket.settles_at_once:  # the key's token counts (Redis): before the answer
            await ticket.settle(*done.usage(), status)
        return Reply(status, headers, body=payload, after=done.run)

    async def _send(self, probe: Probe, body: bytes, req: _Request, plan: Route) -> _Sent:
        """Send the request to the plan's models in turn until one is answered: the next model
        when the last one's error is a reason to fall back (gateway/models/aliases.py), else that error."""
        last = len(plan.models) - 1
        error: GatewayError | None = None
        ticket = None
        for tried, model in enumerate(plan.models):
            if model != probe.model:  # the alias's target, or a fallback (`_attempt` rewrites the body)
                probe = msgspec.structs.replace(probe, model=model)
            attempt = self._attempt(req, probe, body, falls_back=tried < last)
            if tried == 0 and req.tenant is not None and self.quota is not None:
                # The key's (and its team's) limits: the prompt's tokens are charged before routing.
                ticket = await self.quota.admit(req.tenant, model, attempt.facts.prompt_tokens)
            try:
                result = await attempt.until_answered()
                return probe, attempt, result, ticket, error is not None
            except GatewayError as exc:
                reason = fallback_reason(exc) if tried < last else None
                if reason is None:
                    raise await unanswered(self.metrics, self.watcher, exc, error, ticket, probe.model, probe.stream,
                                           req.request_id, req.key_id, req.started, attempt.count) from None
                error = error or exc
                self.metrics.fallback(model, plan.models[tried + 1], reason)
                log.info("gateway.fallback", request_id=req.request_id, model=model,
                         fallback=plan.models[tried + 1], reason=reason, error=exc.message)
            except asyncio.CancelledError:  # the client hung up (gateway/front/front.py) or the server stops
                if ticket is not None:
                    ticket.settle_soon(0, 0, 499)
                outcomes.client_gone(self.metrics, req.started, request_id=req.request_id, key_id=req.key_id,
                                     model=probe.model, stream=probe.stream)
                raise
        raise AssertionError("unreachable: the last model's error is raised")  # pragma: no cover

    def _attempt(self, req: _Request, probe: Probe, body: bytes, falls_back: bool) -> Attempt:
        """The attempts at sending `body` (a request for `probe.model`; a stream that hides the
        usage chunk asks for it anyway), with its routing facts."""
        kind, session, owner = req.kind, req.session, req.owner
        snapshot = self.watcher.snapshot
        is_adapter = snapshot.models.get(probe.model, "") != ""
        warm, full = self.placer.residency(probe.model) if is_adapter else (frozenset(), frozenset())
        if probe.model != req.named:  # the engine gets, and answers with, the real model's name
            body = with_model(body, probe.model)
        generates = kind in GENERATES
        key, key_kind = (None, None)
        if generates and self.policy.name == "fleet":
            key, key_kind = affinity(probe, session, is_adapter)
        base = snapshot.models.get(probe.model) or probe.model
        counter = self.tokenizers.get(base)
        # What the engines hold of the prompt (their KV cache events), with its exact token count.
        exact: int | None = None
        cached: dict[str, int] = {}
        if self.prefix_cache is not None and counter is not None and generates and not is_adapter:
            routes = snapshot.routes.by_model.get(probe.model)
            if routes is not None:
                exact, cached = self.prefix_cache.held(routes.routable, counter, probe)
        estimate, floor = prompt_tokens(probe, kind, exact, counter)
        prefix, prefix_key = shared_prefix(probe, key_kind, estimate)
        pinned = None
        if owner is not None:
            pinned = owner.info.id
            if not owner.serves(probe.model):
                raise InvalidRequest(f"Response `{probe.previous_response_id}` is stored on worker `{pinned}`, "
                                     f"which does not serve `{probe.model}`; continue it with a model it "
                                     "serves.", param="model")
        # Where the key is placed (home, second, heavy) is left to Attempt.next, which looks it
        # up as it decides: a request may wait (the queue, a key's limits) before that.
        facts = RequestFacts(
            model=probe.model, prompt_tokens=estimate, max_tokens=probe.max_new_tokens, session=session,
            seq=self.seq, adapter=is_adapter, warm=warm, full=full, affinity_key=key, affinity_kind=key_kind,
            pinned=pinned, pooling=True if kind == "embeddings" else False if generates else None,
            prefix_tokens=prefix, prefix_key=prefix_key, cached=cached,
        )
        if _hides_usage(probe, kind):  # count every stream's tokens: ask the engine for usage anyway
            body = with_usage(body)
        return Attempt(self.dispatch, req.path, kind, body, probe.stream, facts, floor, req.request_id, req.trace,
                       req.priority, req.key_id if self.classes.enabled else "", falls_back, req.task)

    def refused(self, exc: GatewayError, header: Callable[[str], str | None], key_id: str, started: float) -> None:
        """Log and count a request refused before `serve` (its key, rate limit or body)."""
        self.seq += 1
        exc.request_id = header("x-request-id") or self._next_id()
        outcomes.failed(self.metrics, exc, started, request_id=exc.request_id, key_id=key_id)

    async def stored(self, method: str, response_id: str, suffix: str, query: str) -> Reply:
        """Forward a retrieve (GET) or cancel (POST) of a stored response to the worker that has it."""
        worker = await owner_of(self.watcher, response_id, "response_id")
        status, content_type, data = await forward_stored(
            self.upstream, worker, method, f"{response_id}{suffix}", query, self.settings.first_byte_timeout_s)
        return Reply(status, [("x-fleetgate-worker", worker.info.id), ("content-type", content_type)], body=data)


__all__ = ["Proxy", "Reply"]
