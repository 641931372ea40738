"""The admin JSON API under `/admin` (workers, drain, adapters, the dashboard's reads).

Every handler checks the admin token first (`gateway/tenants/auth.py`); writes poke the fleet
watcher so the next routing snapshot sees them at once.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import structlog
from litestar import Request, Response, delete, get, post
from litestar.datastructures import State

from fleetgate.kv_registry import WorkerKv
from fleetgate.schema import WorkerView
from gateway.api.openapi import FLAG, admin
from gateway.api.openapi_bodies import ADMIN_BODIES
from gateway.api.tenants import flag
from gateway.errors import InvalidRequest, NotFound
from gateway.state import Gateway, gw_of

log = structlog.get_logger("gateway.app")

_NO_WORKER = {404: "No worker has this id"}


def _kv_json(kv: WorkerKv | None) -> dict[str, object] | None:
    """The worker's prefix-cache index from its engine's KV cache events (None: it publishes
    none): `events` while they can be trusted, `lost` with the reason while not; `version` the
    index version this gateway's copy is at ("<generation>-<entry>", as in the Redis stream)."""
    if kv is None:
        return None
    return {"state": kv.state, "reason": kv.reason, "blocks": len(kv.keys), "block_size": kv.block_size,
            "version": f"{kv.gen}-{kv.version}"}


def _worker_json(w: WorkerView, inflight: int, kv: WorkerKv | None = None, pending: int = 0) -> dict[str, object]:
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
        "kv_tokens": info.kv_tokens,
        # What routing weighs the worker by now (measured while it serves), where that
        # came from, and the start-up figure that seeded it (and sizes the affinity ring).
        "speed": w.speed,
        "speed_source": w.speed_source,
        "start_speed": {"value": info.speed, "source": info.speed_source},
        "gpu": msgspec.to_builtins(info.gpu) if info.gpu else None,
        "host": info.host,
        "load": {
            "running": w.load.running,
            "waiting": w.load.waiting,
            "kv_cache_usage": w.load.kv_cache_usage,
            # The engine measured it (routing takes it as the truth), or reports none.
            "kv_measured": w.load.kv_measured,
            "inflight": inflight,
            # Prompt tokens its engine has still to prefill for the streams sent to it (every
            # gateway's) whose first token has not come: its prefill queue, which routing weighs.
            "prefill_pending": pending,
        },
        # LoRA as the engine reports it: its slots (else as registered; 0: unknown), the slots in
        # its record, the adapters with requests in it, and the waiting requests it skipped
        # (mostly for want of a slot).
        "lora": {
            "slots": w.load.lora_slots or info.max_loras,
            "registered": info.max_loras,
            "active": list(w.load.lora_active),
            "deferred": w.load.deferred,
            "runtime_loading": info.runtime_lora,
        },
        "kv_events": _kv_json(kv),
        "circuit": {"state": "open", "reason": w.circuit} if w.circuit else {"state": "closed"},
        "unhealthy": w.load.unhealthy,
        "last_heartbeat": w.last_heartbeat,
        "heartbeat_age_s": round(time.time() - w.last_heartbeat, 3) if w.last_heartbeat else None,
    }


@get("/admin/workers", **admin())
async def admin_workers(request: Request, state: State) -> Response:
    gw = gw_of(state)
    # Read Redis directly: operators want the registry's truth, not a second-old snapshot.
    workers = await gw.registry.read_all()
    inflight = gw.proxy.inflight
    mirror = gw.kv_mirror
    pending = inflight.total_pending
    data = [_worker_json(w, inflight.get(w.id, 0), mirror.status(w.id) if mirror else None, pending.get(w.id, 0))
            for w in workers]
    # Adapter requests this gateway sent where every LoRA slot was taken by others, by adapter.
    waits = dict(sorted(gw.proxy.placer.slot_waits.items()))
    return Response(content=msgspec.json.encode({"data": data, "adapter_slot_waits": waits}),
                    media_type="application/json")


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


@post("/admin/workers/{worker_id:str}/drain", status_code=200, **admin(400, 404, why=_NO_WORKER, params={
    "stop": ("query", FLAG, "true: the worker's agent stops it once drained")}))
async def admin_drain(request: Request, state: State, worker_id: str) -> Response:
    """Stop sending the worker new requests; with `?stop=true` its agent then stops it."""
    gw = gw_of(state)
    return await _admin_write(gw, worker_id, "drain-and-stop" if flag(request, "stop") else "drain")


@post("/admin/workers/{worker_id:str}/undrain", status_code=200, **admin(404, why=_NO_WORKER))
async def admin_undrain(request: Request, state: State, worker_id: str) -> Response:
    gw = gw_of(state)
    return await _admin_write(gw, worker_id, "undrain")


@delete("/admin/workers/{worker_id:str}", status_code=200, **admin(404, why=_NO_WORKER))
async def admin_remove(request: Request, state: State, worker_id: str) -> Response:
    gw = gw_of(state)
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


@post("/admin/workers/{worker_id:str}/adapters", status_code=200,
      **admin(400, 404, 502, 504, why=_NO_WORKER, body=ADMIN_BODIES["adapter"]))
async def admin_load_adapter(request: Request, state: State, worker_id: str) -> Response:
    """Load a LoRA adapter on a worker: body `{"name": ..., "path": ...}` (path optional if configured)."""
    gw = gw_of(state)
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


@delete("/admin/workers/{worker_id:str}/adapters/{name:str}", status_code=200,
        **admin(400, 404, 502, 504, why={404: "No worker has this id, or it has no such adapter"}))
async def admin_unload_adapter(request: Request, state: State, worker_id: str, name: str) -> Response:
    gw = gw_of(state)
    worker = _registered(gw, worker_id)
    if name not in worker.info.adapters:
        raise NotFound(f"Worker `{worker_id}` has no adapter `{name}`.", param="name", code="adapter_not_found")
    await gw.proxy.placer.unload_from(worker, name)
    log.info("gateway.admin", action="unload_adapter", worker=worker_id, adapter=name)
    return Response(content=msgspec.json.encode({"id": worker_id, "adapter": name, "loaded": False}),
                    media_type="application/json")


@get("/admin/decisions", **admin())
async def admin_decisions(request: Request, state: State) -> Response:
    """This gateway's last routing decisions, newest first."""
    gw = gw_of(state)
    log = gw.metrics.decisions
    body = {"data": log.as_json(), "total": log.total}
    return Response(content=msgspec.json.encode(body), media_type="application/json")


@get("/admin/stats", **admin())
async def admin_stats(request: Request, state: State) -> Response:
    """This gateway's counters since start: requests per worker (for rates) and totals."""
    gw = gw_of(state)
    watcher = gw.watcher
    body = {
        "now": time.time(),
        "uptime_s": round(time.time() - gw.metrics.started_at, 3),
        "requests_by_worker": gw.metrics.by_worker,
        "totals": gw.metrics.totals(),
        "registry": "degraded" if watcher.degraded else "ok",
        "snapshot_age_s": round(watcher.age_s, 3) if watcher.snapshot.read_at else None,
        "policy": gw.settings.policy,
    }
    return Response(content=msgspec.json.encode(body), media_type="application/json")


HANDLERS: list[Any] = [
    admin_workers, admin_drain, admin_undrain, admin_remove, admin_load_adapter, admin_unload_adapter,
    admin_decisions, admin_stats,
]
