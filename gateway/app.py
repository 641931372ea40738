"""`create_app(settings)`: the whole gateway, built without module-level state.

The lifespan opens the Redis client, the fleet watcher and the engines' HTTP
session, puts them on `app.state`, and closes them in reverse order.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import structlog
from litestar import Litestar, Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.handlers import HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.response import Stream

from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerView
from gateway import front
from gateway.adapters import AdapterPlacer
from gateway.admission import Admission
from gateway.auth import check_api_key, digest, open_data_plane
from gateway.circuit import Breakers
from gateway.errors import (
    REGISTRY_ERRORS,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    Unauthorized,
    registry_unavailable,
)
from gateway.fastpath import FastPath
from gateway.fleet import FleetWatcher
from gateway.inflight import SharedInflight
from gateway.known import KnownModels
from gateway.lora_state import LoraState
from gateway.metrics import GatewayMetrics, metrics_endpoint
from gateway.openapi import ModelsOperation, StoredResponseOperation, proxied_operation
from gateway.placement import Placement
from gateway.proxy import Proxy
from gateway.ratelimit import RateLimiter
from gateway.requests import KINDS
from gateway.routing import make_policy
from gateway.routing.homes import Homes
from gateway.scaling import ScalingCollector, admin_scaling, current
from gateway.settings import GatewaySettings
from gateway.tokenizers import Tokenizers
from gateway.ui import HANDLERS as UI_HANDLERS
from gateway.ui import admin_authorized
from gateway.upstream import Upstream

log = structlog.get_logger("gateway.app")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


@dataclass
class Gateway:
    """Everything the handlers need, owned by the lifespan."""

    settings: GatewaySettings
    registry: Registry
    watcher: FleetWatcher
    proxy: Proxy
    api_key_digests: frozenset[bytes]
    metrics: GatewayMetrics
    limiter: RateLimiter
    # Said at start and on /health: what an operator must fix (an open data plane, say).
    warnings: tuple[str, ...] = ()


def _gw(state: State) -> Gateway:
    return state["gw"]  # type: ignore[no-any-return]


def _check_client(gw: Gateway, request: Request) -> str:
    return check_api_key(gw.api_key_digests, request.headers.get("authorization", ""))


def _check_admin(gw: Gateway, request: Request) -> None:
    token = gw.settings.admin_token
    # A bearer token, or the dashboard's session cookie (gateway/ui.py).
    if not admin_authorized(request, token):
        raise Unauthorized(
            "Admin endpoints need `Authorization: Bearer <FLEETGATE_ADMIN_TOKEN>`"
            + ("" if token else " (no admin token is configured on this gateway)."),
        )


# -- OpenAI API ---------------------------------------------------------------


async def _proxied(request: Request, state: State, path: str, kind: str) -> Response:
    # Served by gateway/fastpath.py in front of Litestar; this route is the same logic for
    # when the fast path is off, and it documents the operation in the OpenAPI schema.
    gw = _gw(state)
    try:
        reply, hangup = await front.serve(gw, request.headers.get, request.client.host if request.client else None,
                                          request.body, request.receive, path, kind)
    except front.ClientGone:
        return Response(content=b"", status_code=499)  # nobody reads it
    if reply.stream is not None:
        await hangup.stop()  # Litestar's streaming response watches the connection itself
        return Stream(reply.stream, status_code=reply.status, media_type="text/event-stream",
                      headers={**dict(reply.headers), **SSE_HEADERS})
    return Response(content=reply.body, status_code=reply.status, media_type="application/json",
                    headers=dict(reply.headers))


def _proxy_route(path: str, kind: str) -> HTTPRouteHandler:
    """The Litestar route of one proxied OpenAI POST route (the fast path serves the same)."""
    operation, operation_id = proxied_operation(kind)

    async def proxied(request: Request, state: State) -> Response:
        return await _proxied(request, state, path, kind)

    return post(path, status_code=200, operation_class=operation, operation_id=operation_id,
                name=f"proxy-{kind}")(proxied)


async def _stored(request: Request, state: State, method: str, response_id: str, suffix: str) -> Response:
    gw = _gw(state)
    _check_client(gw, request)
    reply = await gw.proxy.stored(method, response_id, suffix, request.url.query)
    headers = dict(reply.headers)
    # The engine's own type: JSON, or an event stream for `?stream=true` (relayed whole).
    return Response(content=reply.body, status_code=reply.status, media_type=headers.pop("content-type"),
                    headers=headers)


@get("/v1/responses/{response_id:str}", operation_class=StoredResponseOperation)
async def retrieve_response(request: Request, state: State, response_id: str) -> Response:
    return await _stored(request, state, "GET", response_id, "")


@post("/v1/responses/{response_id:str}/cancel", status_code=200, operation_class=StoredResponseOperation)
async def cancel_response(request: Request, state: State, response_id: str) -> Response:
    return await _stored(request, state, "POST", response_id, "/cancel")


@get("/v1/models", operation_class=ModelsOperation)
async def list_models(request: Request, state: State) -> Response:
    gw = _gw(state)
    _check_client(gw, request)
    return Response(content=gw.watcher.snapshot.models_json, media_type="application/json")


@get("/v1/models/{model_id:path}")
async def get_model(request: Request, state: State, model_id: str) -> Response:
    gw = _gw(state)
    _check_client(gw, request)
    name = model_id.lstrip("/")
    models = gw.watcher.snapshot.models
    if name not in models:
        raise gw.watcher.absent(ModelNotFound(f"The model `{name}` does not exist.", param="model"), name)
    body = {"id": name, "object": "model", "owned_by": "fleetgate", "parent": models[name] or None}
    return Response(content=msgspec.json.encode(body), media_type="application/json")


@get("/health")
async def health(state: State) -> Response:
    gw = _gw(state)
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


# -- admin --------------------------------------------------------------------


def _worker_json(w: WorkerView, inflight: int) -> dict[str, object]:
    info = w.info
    return {
        "id": info.id,
        "url": info.url,
        "engine": info.engine,
        "state": w.effective_state,
        "agent_state": w.state,
        "admin_drain": w.admin_drain,
        "model": info.model,
        "adapters": list(info.adapters),
        "max_model_len": info.max_model_len,
        "pooling": info.pooling,
        "capacity": info.capacity,
        "speed": info.speed,
        "gpu": msgspec.to_builtins(info.gpu) if info.gpu else None,
        "host": info.host,
        "load": {
            "running": w.load.running,
            "waiting": w.load.waiting,
            "kv_cache_usage": w.load.kv_cache_usage,
            "inflight": inflight,
        },
        "circuit": {"state": "open", "reason": w.circuit} if w.circuit else {"state": "closed"},
        "unhealthy": w.load.unhealthy,
        "last_heartbeat": w.last_heartbeat,
        "heartbeat_age_s": round(time.time() - w.last_heartbeat, 3) if w.last_heartbeat else None,
    }


@get("/admin/workers")
async def admin_workers(request: Request, state: State) -> Response:
    gw = _gw(state)
    _check_admin(gw, request)
    # Read Redis directly: operators want the registry's truth, not a second-old snapshot.
    workers = await gw.registry.read_all()
    inflight = gw.proxy.inflight
    data = [_worker_json(w, inflight.get(w.id, 0)) for w in workers]
    return Response(content=msgspec.json.encode({"data": data}), media_type="application/json")


async def _admin_write(gw: Gateway, worker_id: str, action: str) -> Response:
    if action == "remove":
        found = await gw.registry.deregister(worker_id, by_operator=True)
    elif action == "drain-and-stop":
        found = await gw.registry.request_stop(worker_id)
    else:
        found = await gw.registry.set_admin_drain(worker_id, action == "drain")
    if not found:
        raise NotFound(f"No worker `{worker_id}` is registered.", param="id", code="worker_not_found")
    gw.watcher.poke()
    log.info("gateway.admin", action=action, worker=worker_id)
    body = {"id": worker_id, "action": action, "ok": True}
    return Response(content=msgspec.json.encode(body), media_type="application/json")


@post("/admin/workers/{worker_id:str}/drain", status_code=200)
async def admin_drain(request: Request, state: State, worker_id: str) -> Response:
    """Stop sending the worker new requests; with `?stop=true` its agent then stops it."""
    gw = _gw(state)
    _check_admin(gw, request)
    stop = request.query_params.get("stop", "false").lower()
    if stop not in ("true", "false", "1", "0"):
        raise InvalidRequest("`stop` must be true or false.", param="stop")
    return await _admin_write(gw, worker_id, "drain-and-stop" if stop in ("true", "1") else "drain")


@post("/admin/workers/{worker_id:str}/undrain", status_code=200)
async def admin_undrain(request: Request, state: State, worker_id: str) -> Response:
    gw = _gw(state)
    _check_admin(gw, request)
    return await _admin_write(gw, worker_id, "undrain")


@delete("/admin/workers/{worker_id:str}", status_code=200)
async def admin_remove(request: Request, state: State, worker_id: str) -> Response:
    gw = _gw(state)
    _check_admin(gw, request)
    return await _admin_write(gw, worker_id, "remove")


class AdapterLoad(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    # Optional when the adapter is in the gateway's `adapters` config.
    path: str | None = None


def _registered(gw: Gateway, worker_id: str) -> WorkerView:
    worker = gw.watcher.snapshot.by_id.get(worker_id)
    if worker is None:
        raise NotFound(f"No worker `{worker_id}` is registered.", param="id", code="worker_not_found")
    if not worker.info.runtime_lora:
        raise InvalidRequest(
            f"Worker `{worker_id}` ({worker.info.engine}) cannot load adapters at runtime; "
            "give them to its agent at start (--adapters).", code="adapters_fixed_at_start",
        )
    return worker


@post("/admin/workers/{worker_id:str}/adapters", status_code=200)
async def admin_load_adapter(request: Request, state: State, worker_id: str) -> Response:
    """Load a LoRA adapter on a worker: body `{"name": ..., "path": ...}` (path optional if configured)."""
    gw = _gw(state)
    _check_admin(gw, request)
    try:
        load = msgspec.json.decode(await request.body(), type=AdapterLoad)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Body must be {{\"name\": ..., \"path\": ...}}: {exc}") from exc
    if not load.name or "/" in load.name:
        raise InvalidRequest("`name` must be a non-empty adapter name without '/'.", param="name")
    worker = _registered(gw, worker_id)
    try:
        await gw.proxy.placer.load_on(worker, load.name, load.path)
    except KeyError:
        raise InvalidRequest(f"Adapter `{load.name}` is not configured; send its `path`.", param="path") from None
    log.info("gateway.admin", action="load_adapter", worker=worker_id, adapter=load.name)
    return Response(content=msgspec.json.encode({"id": worker_id, "adapter": load.name, "loaded": True}),
                    media_type="application/json")


@delete("/admin/workers/{worker_id:str}/adapters/{name:str}", status_code=200)
async def admin_unload_adapter(request: Request, state: State, worker_id: str, name: str) -> Response:
    gw = _gw(state)
    _check_admin(gw, request)
    worker = _registered(gw, worker_id)
    if name not in worker.info.adapters:
        raise NotFound(f"Worker `{worker_id}` has no adapter `{name}`.", param="name", code="adapter_not_found")
    await gw.proxy.placer.unload_from(worker, name)
    log.info("gateway.admin", action="unload_adapter", worker=worker_id, adapter=name)
    return Response(content=msgspec.json.encode({"id": worker_id, "adapter": name, "loaded": False}),
                    media_type="application/json")


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
    return _gateway_error(request, err)


def _registry_error(request: Request, exc: Exception) -> Response:
    log.warning("gateway.registry_error", path=request.url.path, error=repr(exc))
    return _gateway_error(request, registry_unavailable())


def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("gateway.internal_error", path=request.url.path)
    return _gateway_error(request, GatewayError("Internal error in the gateway."))


def create_app(settings: GatewaySettings) -> Litestar:
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
            registry, lambda worker_id: watcher.snapshot.by_id.get(worker_id), watcher.poke,
            threshold=settings.breaker_threshold, cooldown_s=settings.breaker_cooldown_s,
            max_cooldown_s=settings.breaker_max_cooldown_s,
        )
        metrics = GatewayMetrics()
        metrics.model_label = watcher.known.label
        metrics.watch_fleet(watcher, inflight)
        lora_state = LoraState(registry, gateway_id)
        placer = AdapterPlacer(dict(settings.adapters), watcher, registry, inflight, lora_state)
        policy = make_policy(settings.policy, settings.routing)
        opts = getattr(policy, "opts", None)
        homes = Homes(half_life_s=getattr(opts, "half_life_s", 30.0),
                      second_hold_s=getattr(opts, "second_hold_s", 10.0),
                      imbalance=getattr(opts, "balance", 0.25))
        placement = Placement(homes, lambda: watcher.snapshot.routes, inflight.tokens,
                              heavy_share=getattr(opts, "heavy_share", 0.3))
        # The queue is as long as the fleet is wide (every worker's batch once), at least queue_max.
        admission = Admission(lambda: max(settings.queue_max, sum(
            w.info.capacity for w in watcher.snapshot.workers if w.routable)))
        proxy = Proxy(
            settings, watcher, upstream, policy, inflight, breakers, metrics, placer, placement, admission,
            tokenizers=Tokenizers(settings.tokenizers, lambda: watcher.snapshot),
        )
        metrics.registry.register(ScalingCollector(lambda: current(watcher, inflight, admission)))
        exposed = open_data_plane(settings.host, settings.api_keys)
        app.state["gw"] = Gateway(
            settings, registry, watcher, proxy, frozenset(digest(k) for k in settings.api_keys),
            metrics, RateLimiter(registry, settings.rate_limit_rpm, settings.rate_limit_burst),
            (exposed,) if exposed else (),
        )
        with contextlib.suppress(Exception):  # Redis away at start: the placer's loop retries
            await placer.restore()  # before the first snapshot, which lists what it learnt
        await watcher.start()
        placer.start()
        lora_state.start(lambda: [w.id for w in watcher.snapshot.workers if w.info.max_loras > 0])
        inflight.start()
        placement.start()
        log.info("gateway.started", gateway_id=gateway_id, **settings.public())
        if exposed:
            log.warning("gateway.open_data_plane", host=settings.host, message=exposed)
        try:
            yield
        finally:
            await placement.stop()
            await proxy.waits.stop()
            await placer.close()
            await lora_state.stop()
            await breakers.close()
            await inflight.stop()
            await watcher.stop()
            await upstream.close()
            await redis.aclose()
            log.info("gateway.stopped")

    make_policy(settings.policy, settings.routing)  # fail at start-up, not on the first request
    return Litestar(
        route_handlers=[
            *(_proxy_route(path, kind) for path, kind in KINDS.items()),
            retrieve_response, cancel_response, list_models, get_model, health,
            admin_workers, admin_drain, admin_undrain, admin_remove,
            admin_load_adapter, admin_unload_adapter, admin_scaling, metrics_endpoint, *UI_HANDLERS,
        ],
        lifespan=[lifespan],
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            **dict.fromkeys(REGISTRY_ERRORS, _registry_error),
            Exception: _internal_error,
        },
        # Litestar's default path: the schema at /schema/openapi.json.
        openapi_config=OpenAPIConfig(title="fleetgate", version="0.1.0"),
        logging_config=None,
        request_max_body_size=settings.max_body_bytes,
    )


def create_asgi(settings: GatewaySettings) -> FastPath | Litestar:
    """The app to serve: the fast data path in front of `create_app(settings)`."""
    app = create_app(settings)
    return FastPath(app) if settings.fast_path else app
