"""The admin API for aliases and fallbacks (docs/operations.md, "Aliases and fallbacks").

    GET    /admin/aliases           the effective aliases (the YAML's overlaid by the live ones)
    PUT    /admin/aliases/{name}    {"targets": [{"model": "a", "weight": 90}, ...]}
    DELETE /admin/aliases/{name}    also hides a YAML alias of that name (until a PUT)
    GET    /admin/fallbacks         PUT / DELETE /admin/fallbacks/{model}: {"models": ["b", ...]}

A write is checked against the effective routes it would make (the rules of the YAML's,
gateway/models/aliases.py `problems`), lands in Redis, is announced to every replica
(gateway/models/live_routes.py) and read back by this replica before it answers.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import structlog
from litestar import Request, Response, delete, get, put
from litestar.datastructures import State

from gateway.api.openapi import PUT_ANSWERS, ROUTE_NAME, ROUTE_NAME_RE, admin
from gateway.api.openapi_bodies import ADMIN_BODIES
from gateway.api.tenants import _json, decode_body
from gateway.errors import InvalidRequest, NotFound
from gateway.models.live_routes import AliasSpec, FallbackSpec, Kind, LiveRoutes, Routes
from gateway.state import gw_of

log = structlog.get_logger("gateway.app")

_CONFLICT = {409: "The routes it would make have a problem the write adds (an alias naming another "
                  "alias, a model falling back to itself)"}


def _name_param(kind: Kind) -> dict[str, tuple[str, dict[str, str], str]]:
    return {"name" if kind == "alias" else "model": ("path", ROUTE_NAME, f"The {kind}'s name")}


def _name(raw: str, kind: Kind) -> str:
    # A model name may hold slashes (org/model): the path converter keeps them; leading ones go.
    if not re.fullmatch(ROUTE_NAME_RE, raw):
        name = raw.lstrip("/")
        raise InvalidRequest(f"An {kind} name is 1-256 characters without spaces; got `{name}`.", param="name")
    return raw.lstrip("/")


def _check(before: Routes, after: Routes, kind: Kind, value: tuple[Any, ...]) -> None:
    """Refuse a write that adds a problem (a problem already there is not this write's): a
    400 when the body is wrong on its own, a 409 when the routes it would make are (an alias
    naming an alias, a model its own fallback)."""
    old = set(before.problems())
    if new := [p for p in after.problems() if p not in old]:
        error = InvalidRequest("; ".join(new) + ".", param="targets" if kind == "alias" else "models")
        if not _malformed(kind, value):
            error.status, error.code = 409, "route_conflict"
        raise error


def _malformed(kind: Kind, value: tuple[Any, ...]) -> bool:
    """Whether a body breaks the document's own constraints (gateway/api/openapi_bodies.py)."""
    if kind == "fallback":
        return not value or not all(value)
    return (not value or not all(t.model for t in value) or not all(t.weight >= 0 for t in value)
            or not any(t.weight > 0 for t in value))


def _listing(routes: Routes, kind: Kind) -> list[dict[str, Any]]:
    if kind == "alias":
        return [{"name": n, "targets": [msgspec.structs.asdict(t) for t in ts], "source": routes.source(kind, n)}
                for n, ts in sorted(routes.aliases.items())]
    return [{"model": m, "models": list(ms), "source": routes.source(kind, m)}
            for m, ms in sorted(routes.fallbacks.items())]


async def _put(request: Request, state: State, kind: Kind, raw_name: str) -> Response:
    gw = gw_of(state)
    name = _name(raw_name, kind)
    store: LiveRoutes = gw.tenants.routes
    before = await store.read()
    if kind == "alias":
        spec: AliasSpec | FallbackSpec = await decode_body(request, AliasSpec)
        value: tuple[Any, ...] = spec.targets  # type: ignore[union-attr]
    else:
        spec = await decode_body(request, FallbackSpec)
        value = spec.models  # type: ignore[union-attr]
    _check(before, before.changed(kind, name, value), kind, value)
    created = name not in (before.aliases if kind == "alias" else before.fallbacks)
    await store.put(kind, name, spec)
    after = await store.read()
    log.info("gateway.admin", action=f"put_{kind}", name=name, created=created)
    entry = next(e for e in _listing(after, kind) if e["name" if kind == "alias" else "model"] == name)
    return _json({kind: entry, "created": created}, 201 if created else 200)


async def _delete(request: Request, state: State, kind: Kind, raw_name: str) -> Response:
    gw = gw_of(state)
    name = _name(raw_name, kind)
    store: LiveRoutes = gw.tenants.routes
    before = await store.read()
    if name not in (before.aliases if kind == "alias" else before.fallbacks):
        raise NotFound(f"No {kind} `{name}`.", param="name", code=f"{kind}_not_found")
    await store.delete(kind, name)
    await store.read()
    log.info("gateway.admin", action=f"delete_{kind}", name=name)
    return _json({"name": name, "deleted": True})


@get("/admin/aliases", **admin())
async def list_aliases(request: Request, state: State) -> Response:
    gw = gw_of(state)
    return _json({"data": _listing(await gw.tenants.routes.read(), "alias")})


@put("/admin/aliases/{name:path}", status_code=200, **admin(
    400, 409, body=ADMIN_BODIES["alias"], ok=PUT_ANSWERS, why=_CONFLICT, params=_name_param("alias")))
async def put_alias(request: Request, state: State, name: str) -> Response:
    return await _put(request, state, "alias", name)


@delete("/admin/aliases/{name:path}", status_code=200, **admin(
    400, 404, why={404: "No alias has this name"}, params=_name_param("alias")))
async def delete_alias(request: Request, state: State, name: str) -> Response:
    return await _delete(request, state, "alias", name)


@get("/admin/fallbacks", **admin())
async def list_fallbacks(request: Request, state: State) -> Response:
    gw = gw_of(state)
    return _json({"data": _listing(await gw.tenants.routes.read(), "fallback")})


@put("/admin/fallbacks/{model:path}", status_code=200, **admin(
    400, 409, body=ADMIN_BODIES["fallback"], ok=PUT_ANSWERS, why=_CONFLICT, params=_name_param("fallback")))
async def put_fallback(request: Request, state: State, model: str) -> Response:
    return await _put(request, state, "fallback", model)


@delete("/admin/fallbacks/{model:path}", status_code=200, **admin(
    400, 404, why={404: "No fallback chain for this model"}, params=_name_param("fallback")))
async def delete_fallback(request: Request, state: State, model: str) -> Response:
    return await _delete(request, state, "fallback", model)


HANDLERS: list[Any] = [list_aliases, put_alias, delete_alias, list_fallbacks, put_fallback, delete_fallback]
