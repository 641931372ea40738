"""`create_app(settings)`: the whole gateway, built without module-level state.

The lifespan opens the Redis client, the fleet watcher and the engines' HTTP
session, puts them on `app.state`, and closes them in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import structlog
from litestar import Litestar, Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.types import ASGIApp
from prometheus_client import CONTENT_TYPE_LATEST

from fleetgate.background import stop_tasks
from fleetgate.kv_registry import KvMirror
from fleetgate.registry import Registry, connect
from gateway import ACCEL
from gateway.accounts.adapters import AdapterPlacer
from gateway.accounts.admission import Admission
from gateway.accounts.circuit import Breakers
from gateway.accounts.inflight import SharedInflight
from gateway.accounts.lora_state import LoraState
from gateway.accounts.placement import Placement
from gateway.accounts.priorities import Priorities, PriorityCollector
from gateway.api.admin import HANDLERS as ADMIN_HANDLERS
from gateway.api.openapi import (
    ADMIN_SECURITY,
    CLIENT_SECURITY,
    COMPONENTS,
    documented,
    json_answer,
    proxied,
    stored,
)
from gateway.api.openapi_bodies import MODEL, MODEL_LIST
from gateway.api.options import with_options
from gateway.api.routes import HANDLERS as ROUTE_HANDLERS
from gateway.api.scaling import ScalingCollector, admin_scaling, current
from gateway.api.tenants import HANDLERS as TENANT_HANDLERS
from gateway.api.ui import HANDLERS as UI_HANDLERS
from gateway.engines.upstream import Upstream
from gateway.errors import (
    REGISTRY_ERRORS,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    registry_unavailable,
)
from gateway.fleet import FleetWatcher
from gateway.front import asgi_answer, gctune
from gateway.front.fastpath import FastPath
from gateway.front.front_limits import FrontGuard
from gateway.models.aliases import listed
from gateway.models.known import KnownModels
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.tracing import Tracing
from gateway.request.prefix_cache import KvIndexCollector, PrefixCache
from gateway.request.proxy import Proxy
from gateway.request.requests import KINDS
from gateway.request.tokenizers import Tokenizers
from gateway.routing import make_policy
from gateway.routing.homes import Homes
from gateway.settings import GatewaySettings
from gateway.state import Gateway, gw_of
from gateway.tenancy import ReloadSeed, Tenancy, open_tenancy
from gateway.tenants.auth import admin_guard, open_data_plane
from gateway.tenants.ratelimit import RateLimiter

log = structlog.get_logger("gateway.app")

def _check_client(gw: Gateway, request: Request) -> None:
    gw.tenants.directory.authenticate(request.headers.get("authorization", ""))


# -- OpenAI API ---------------------------------------------------------------


def _proxy_route(path: str, kind: str) -> HTTPRouteHandler:
    """The Litestar route of one proxied OpenAI POST route: taken with `fast_path: false`, it
    documents the operation in the OpenAPI schema and hands the request to the one answer path
    (gateway/front/answer.py) as the fast path does, through ASGI (gateway/front/asgi_answer.py)."""
    async def proxied_route(state: State) -> ASGIApp:
        gw = gw_of(state)

        async def answer(scope: asgi_answer.Scope, receive: asgi_answer.Receive, send: asgi_answer.Send) -> None:
            await asgi_answer.answer(gw, scope, receive, send, kind, path)

        return answer  # type: ignore[return-value]  # (Litestar's TypedDict messages: ASGI's dicts here)

    return post(path, status_code=200, name=f"proxy-{kind}", **proxied(kind))(proxied_route)


async def _stored(request: Request, state: State, method: str, response_id: str, suffix: str) -> Response:
    gw = gw_of(state)
    _check_client(gw, request)
    reply = await gw.proxy.stored(method, response_id, suffix, request.url.query)
    headers = dict(reply.headers)
    # An engine refuses to cancel a response that is not running with a 400 (vLLM's "Cannot
    # cancel a synchronous response"): the request is well formed and conflicts with the
    # response's state, a 409.
    status = 409 if suffix == "/cancel" and reply.status == 400 else reply.status
    # The engine's own type: JSON, or an event stream for `?stream=true` (relayed whole).
    return Response(content=reply.body, status_code=status, media_type=headers.pop("content-type"),
                    headers=headers)


@get("/v1/responses/{response_id:str}", **stored("getResponse", "Retrieve a stored response"))
async def retrieve_response(request: Request, state: State, response_id: str) -> Response:
    return await _stored(request, state, "GET", response_id, "")


@post("/v1/responses/{response_id:str}/cancel", status_code=200,
      **stored("cancelResponse", "Cancel a background response", 409))
async def cancel_response(request: Request, state: State, response_id: str) -> Response:
    return await _stored(request, state, "POST", response_id, "/cancel")


@get("/v1/models", operation_id="listModels", security=CLIENT_SECURITY,
     **documented(401, ok={200: json_answer("Models and adapters the ready fleet serves", MODEL_LIST)}))
async def list_models(request: Request, state: State) -> Response:
    gw = gw_of(state)
    _check_client(gw, request)
    return Response(content=listed(gw.tenants.routes.current.aliases, gw.watcher.snapshot.models_json),
                    media_type="application/json")


@get("/v1/models/{model_id:path}", operation_id="retrieveModel", security=CLIENT_SECURITY,
     **documented(401, 404, 503, ok={200: json_answer("The model, adapter or alias", MODEL)},
                  why={404: "No worker serves this model or adapter, and no alias has its name",
                       503: "The model was served recently and no worker serves it now, or the "
                            "gateway cannot reach its registry (Retry-After)"}))
async def get_model(request: Request, state: State, model_id: str) -> Response:
    gw = gw_of(state)
    _check_client(gw, request)
    name = model_id.lstrip("/")
    snapshot = gw.watcher.snapshot
    if (targets := gw.tenants.routes.current.aliases.get(name)) is not None:
        body = {"id": name, "object": "model", "created": 0, "owned_by": "fleetgate", "parent": None,
                "fleetgate_alias_of": [t.model for t in targets]}
        return Response(content=msgspec.json.encode(body), media_type="application/json")
    if name not in snapshot.models:
        raise gw.watcher.absent(ModelNotFound(f"The model `{name}` does not exist.", param="model"), name)
    # The same entry as in /v1/models (OpenAI's Model object: `created` too).
    entry = next(m for m in msgspec.json.decode(snapshot.models_json)["data"] if m["id"] == name)
    return Response(content=msgspec.json.encode(entry), media_type="application/json")


@get("/metrics", include_in_schema=False)
async def metrics_endpoint(state: State) -> Response:
    """Prometheus scrape; open like /health (put it behind your network's rules)."""
    return Response(content=state["gw"].metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@get("/health", **documented(ok={200: json_answer("The gateway is up; `degraded` when it cannot read its registry")}))
async def health(state: State) -> Response:
    gw = gw_of(state)
    watcher = gw.watcher
    ready = sum(1 for w in watcher.snapshot.workers if w.routable)
    body = {
        "status": "degraded" if watcher.degraded else "ok",
        "workers": len(watcher.snapshot.workers),
        "ready_workers": ready,
        "snapshot_age_s": round(watcher.age_s, 3) if watcher.snapshot.read_at else None,
        **({"registry_error": watcher.last_error} if watcher.degraded else {}),
        **({"warnings": list(gw.warnings)} if gw.warnings else {}),
    }
    return Response(content=msgspec.json.encode(body), media_type="application/json")


# -- errors -------------------------------------------------------------------


def _gateway_error(request: Request, exc: GatewayError) -> Response:
    return Response(
        content=exc.body(), status_code=exc.status, media_type="application/json", headers=exc.headers()
    )


def _http_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 404:
        err: GatewayError = NotFound(f"No route for {request.method} {request.url.path}.")
    elif status == 405:
        err = InvalidRequest(f"Method {request.method} is not allowed on {request.url.path}.")
        err.status = 405
    elif status < 500:
        err = InvalidRequest(str(exc.detail))
        err.status = status
    else:
        err = GatewayError("Internal error in the gateway.")
    if status == 405 and exc.headers:  # Litestar names the allowed methods: `Allow`, as RFC 9110 asks
        return Response(content=err.body(), status_code=405, media_type="application/json",
                        headers={**err.headers(), **exc.headers})
    return _gateway_error(request, err)


def _registry_error(request: Request, exc: Exception) -> Response:
    log.warning("gateway.registry_error", path=request.url.path, error=repr(exc))
    return _gateway_error(request, registry_unavailable())


def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("gateway.internal_error", path=request.url.path)
    return _gateway_error(request, GatewayError("Internal error in the gateway."))


async def _close(part: str, close: Callable[[], Awaitable[object]], timeout_s: float = 5.0) -> None:
    """Close one part of the gateway on the way out, bounded: a background task that does not
    end when cancelled (a Redis call that swallowed the cancellation) must not hold the
    process up, nor keep the parts after it open."""
    try:
        await asyncio.wait_for(close(), timeout_s)
    except TimeoutError:
        log.warning("gateway.close_timed_out", part=part, timeout_s=timeout_s)
    except Exception as exc:
        log.warning("gateway.close_failed", part=part, error=repr(exc))


def build_tracing(settings: GatewaySettings, instance_id: str) -> Tracing:
    """The gateway's tracing: off, or the SDK exporting to `settings.tracing_endpoint`."""
    if not settings.tracing_endpoint:
        return Tracing()
    try:
        from gateway.observe.tracing_otel import OtelTracing
    except ImportError as exc:  # the SDK is an extra
        raise RuntimeError(
            "tracing_endpoint is set but the OpenTelemetry SDK is not installed: "
            "pip install 'fleetgate[tracing]'"
        ) from exc
    return OtelTracing.exporting(settings.tracing_endpoint, settings.tracing_service, instance_id)


def create_app(settings: GatewaySettings, reload_seed: ReloadSeed | None = None,
               front: FrontGuard | None = None) -> Litestar:
    """The gateway; `reload_seed` reads the config file again (on SIGHUP: gateway/tenancy.py);
    `front`: the limits on client connections that its server keeps (gateway/front/front_limits.py),
    whose refusals /metrics counts."""
    front = front if front is not None else FrontGuard.from_settings(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        redis = connect(settings.redis_url)
        registry = Registry(
            redis, settings.redis_prefix, settings.heartbeat_ttl_s, secret=settings.registration_secret
        )
        watcher = FleetWatcher(
            registry, settings.refresh_interval_s, {name: a.base for name, a in settings.adapters.items()},
            KnownModels(settings.model_memory_s),
        )
        upstream = Upstream(settings.connect_timeout_s)
        await upstream.start()
        gateway_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        inflight = SharedInflight(registry, gateway_id)
        breakers = Breakers(
            registry, lambda worker_id: watcher.snapshot.by_id.get(worker_id), watcher.poke, upstream,
            threshold=settings.breaker_threshold, cooldown_s=settings.breaker_cooldown_s,
            max_cooldown_s=settings.breaker_max_cooldown_s,
        )
        metrics = GatewayMetrics()
        metrics.model_label = watcher.known.label
        metrics.watch_fleet(watcher, inflight)
        lora_state = LoraState(registry, gateway_id)
        placer = AdapterPlacer(dict(settings.adapters), watcher, registry, inflight, lora_state, upstream)
        policy = make_policy(settings.policy, settings.routing)
        tracing = build_tracing(settings, gateway_id)
        opts = getattr(policy, "opts", None)
        homes = Homes(half_life_s=getattr(opts, "half_life_s", 30.0),
                      second_hold_s=getattr(opts, "second_hold_s", 10.0),
                      imbalance=getattr(opts, "balance", 0.25))
        placement = Placement(homes, lambda: watcher.snapshot.routes, inflight.tokens,
                              heavy_share=getattr(opts, "heavy_share", 0.3), fresh=inflight.total_fresh)
        # The queue is as long as the fleet is wide (every worker's batch once), at least queue_max.
        admission = Admission(lambda: max(settings.queue_max, sum(
            w.info.capacity for w in watcher.snapshot.workers if w.routable)), weights=priorities.weights)
        # Each worker's prefix-cache index, as its agent publishes it from the engine's KV cache
        # events: read in the background, never on the request path.
        kv_mirror = KvMirror(settings.redis_prefix)
        proxy = Proxy(
            settings, watcher, upstream, policy, inflight, breakers, metrics, placer, placement, admission,
            priorities=priorities,
            tokenizers=Tokenizers(settings.tokenizers,
                                  (lambda: watcher.snapshot) if settings.registered_tokenizers else None),
            tracing=tracing,
            prefix_cache=PrefixCache(kv_mirror) if getattr(opts, "kv_events", False) else None,
        )
        metrics.registry.register(ScalingCollector(lambda: current(watcher, inflight, admission)))
        metrics.registry.register(PriorityCollector(admission, list(priorities.classes)))
        metrics.registry.register(placer.collector())
        metrics.registry.register(KvIndexCollector(kv_mirror, lambda: watcher.snapshot.by_id.keys()))
        metrics.registry.register(front.collector())
        tenancy = await open_tenancy(settings, redis, registry.keys, metrics.registry, watcher.known.label,
                                     reload_seed)
        proxy.quota = tenancy.quota
        proxy.routes = lambda: tenancy.store.routes.current
        priorities.key_class = _key_class(tenancy, priorities.key_class)
        exposed = open_data_plane(settings.host, (*settings.api_keys, *tenancy.store.directory.keys))
        app.state["gw"] = Gateway(
            settings, registry, watcher, proxy, metrics,
            RateLimiter(registry, settings.rate_limit_rpm, settings.rate_limit_burst), tenancy,
            (exposed,) if exposed else (), kv_mirror,
        )
        kv_task = asyncio.create_task(kv_mirror.run(redis, lambda: watcher.snapshot.by_id.keys()), name="kv-mirror")
        with contextlib.suppress(Exception):  # Redis away at start: the placer's loop retries
            await placer.restore()  # before the first snapshot, which lists what it learnt
        await watcher.start()
        placer.start()
        lora_state.start(lambda: [w.id for w in watcher.snapshot.workers if w.info.max_loras > 0])
        inflight.start()
        placement.start()
        gctune.settle()
        # accel: whether the request path runs compiled (gateway/accel.py: compiled, pure, stale, disabled).
        log.info("gateway.started", gateway_id=gateway_id, pid=os.getpid(), accel=ACCEL, **settings.public())
        if exposed:
            log.warning("gateway.open_data_plane", host=settings.host, message=exposed)
        try:
            yield
        finally:
            for part, close in (
                ("kv_mirror", lambda: stop_tasks(kv_task)),
                ("placement", placement.stop), ("tenancy", tenancy.close), ("waits", proxy.waits.stop),
                ("adapters", placer.close), ("lora_state", lora_state.stop), ("breakers", breakers.close),
                ("inflight", inflight.stop), ("watcher", watcher.stop), ("upstream", upstream.close),
                ("redis", redis.aclose),
                ("tracing", tracing.shutdown),  # exports the last spans
            ):
                await _close(part, close)
            log.info("gateway.stopped")

    make_policy(settings.policy, settings.routing)  # fail at start-up, not on the first request
    priorities = Priorities.from_settings(settings)
    return Litestar(
        route_handlers=[
            *(_proxy_route(path, kind) for path, kind in KINDS.items()),
            retrieve_response, cancel_response, list_models, get_model, health,
            metrics_endpoint,
            # Every admin API route, behind one guard (the dashboard's pages ask for a login instead).
            Router("/", route_handlers=with_options([admin_scaling, *ADMIN_HANDLERS, *TENANT_HANDLERS,
                                                     *ROUTE_HANDLERS]),
                   guards=[admin_guard], security=ADMIN_SECURITY),
            *UI_HANDLERS,
        ],
        lifespan=[lifespan],
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            **dict.fromkeys(REGISTRY_ERRORS, _registry_error),
            Exception: _internal_error,
        },
        # Litestar's default path: the schema at /schema/openapi.json.
        openapi_config=OpenAPIConfig(title="fleetgate", version="0.1.0", components=COMPONENTS),
        logging_config=None,
        request_max_body_size=settings.max_body_bytes,
    )


def create_asgi(settings: GatewaySettings, reload_seed: ReloadSeed | None = None,
                front: FrontGuard | None = None) -> FastPath | Litestar:
    """The app to serve: the fast data path in front of `create_app(settings)`."""
    app = create_app(settings, reload_seed, front)
    return FastPath(app) if settings.fast_path else app


def _key_class(tenancy: Tenancy, configured: Callable[[str], str]) -> Callable[[str], str]:
    """A key's priority class: its live record's (gateway/tenants/tenants.py) unless that says
    "default", else what `key_priority` configures for it."""
    def key_class(key_id: str) -> str:
        record = tenancy.store.directory.keys.get(key_id)
        return record.priority if record is not None and record.priority != "default" else configured(key_id)
    return key_class
