"""The admin API for keys, teams and usage (docs/tenants.md).

    GET    /admin/keys            every key (never a secret, nor its digest)
    PUT    /admin/keys/{id}       create or replace a key: a KeySpec body; the secret in clear
                                  comes back once when generated (`?rotate=true`: a new one)
    DELETE /admin/keys/{id}
    GET    /admin/teams           PUT / DELETE /admin/teams/{id}: a TeamSpec body
    GET    /admin/usage           ?key= &model= &day=YYYY-MM-DD (else today) &days=N (back from day)

A write lands in Redis, is announced to every replica (gateway/tenants/tenant_store.py), and is
read back by this replica before it answers, so the key works here at once.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Any

import msgspec
import structlog
from litestar import Request, Response, delete, get, put
from litestar.datastructures import State

from gateway.api.openapi import DAY_RE, FLAG, FLAG_RE, PUT_ANSWERS, TENANT_ID, admin
from gateway.api.openapi_bodies import ADMIN_BODIES
from gateway.errors import InvalidRequest, NotFound
from gateway.state import gw_of
from gateway.tenants.tenants import KeySpec, TeamSpec, check_id, new_secret
from gateway.tenants.usage import days_back, parse_day, read_usage, totals

log = structlog.get_logger("gateway.app")


def _json(body: object, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(body), status_code=status, media_type="application/json")


async def decode_body(request: Request, kind: type[Any]) -> Any:
    """The request's JSON body as `kind` (a msgspec Struct); a clear 400 when it is not one.
    Shared with gateway/api/routes.py."""
    raw = await request.body()
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid {kind.__name__}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}") from exc


def flag(request: Request, name: str) -> bool:
    """A yes/no query parameter (absent: no); anything but true/false/1/0 is a 400."""
    value = request.query_params.get(name)
    if value is None:
        return False
    if not re.fullmatch(FLAG_RE, value):
        raise InvalidRequest(f"`{name}` must be true or false.", param=name)
    return value.lower() in ("true", "1")


@get("/admin/keys", **admin())
async def list_keys(request: Request, state: State) -> Response:
    gw = gw_of(state)
    keys, _ = await gw.tenants.read()
    static = [k for k in gw.tenants.directory.ids if k not in {r.id for r in keys}]
    return _json({"data": [k.public() for k in sorted(keys, key=lambda k: k.id)],
                  "static": sorted(static)})


@put("/admin/keys/{key_id:str}", status_code=200, **admin(
    400, 409, body=ADMIN_BODIES["key"], body_required=False, ok=PUT_ANSWERS,
    why={409: "The key names a team that does not exist (create it first)"},
    params={"key_id": ("path", TENANT_ID, "The key's id (not its secret)"),
            "rotate": ("query", FLAG, "true: a new secret, shown once (unless the body gives one)")}))
async def put_key(request: Request, state: State, key_id: str) -> Response:
    gw = gw_of(state)
    check_id("key", key_id)
    spec: KeySpec = await decode_body(request, KeySpec)
    if flag(request, "rotate") and spec.secret is None and spec.secret_sha256 is None:
        # A new secret: generated, unless the body gives one (which replaces it as well).
        spec = msgspec.structs.replace(spec, secret=new_secret())
    if spec.team:
        _, teams = await gw.tenants.read()
        if spec.team not in {t.id for t in teams}:
            conflict = InvalidRequest(f"No team `{spec.team}`: create it first (PUT /admin/teams/{spec.team}).",
                                      param="team", code="team_not_found")
            conflict.status = 409
            raise conflict
    existed = await gw.tenants.get_key(key_id) is not None
    record, secret = await gw.tenants.put_key(key_id, spec)
    await gw.tenants.reload()
    log.info("gateway.admin", action="put_key", key_id=key_id, created=not existed)
    body: dict[str, object] = {"key": record.public(), "created": not existed}
    if secret is not None:
        body["secret"] = secret
    return _json(body, 201 if not existed else 200)


@delete("/admin/keys/{key_id:str}", status_code=200, **admin(404, why={404: "No key has this id"}))
async def delete_key(request: Request, state: State, key_id: str) -> Response:
    gw = gw_of(state)
    if not await gw.tenants.delete("key", key_id):
        raise NotFound(f"No key `{key_id}`.", param="id", code="key_not_found")
    await gw.tenants.reload()
    log.info("gateway.admin", action="delete_key", key_id=key_id)
    return _json({"id": key_id, "deleted": True})


@get("/admin/teams", **admin())
async def list_teams(request: Request, state: State) -> Response:
    gw = gw_of(state)
    keys, teams = await gw.tenants.read()
    members: dict[str, list[str]] = {}
    for k in keys:
        members.setdefault(k.team, []).append(k.id)
    return _json({"data": [{**msgspec.structs.asdict(t), "keys": sorted(members.get(t.id, []))}
                           for t in sorted(teams, key=lambda t: t.id)]})


@put("/admin/teams/{team_id:str}", status_code=200, **admin(
    400, body=ADMIN_BODIES["team"], body_required=False, ok=PUT_ANSWERS,
    params={"team_id": ("path", TENANT_ID, "The team's id")}))
async def put_team(request: Request, state: State, team_id: str) -> Response:
    gw = gw_of(state)
    spec: TeamSpec = await decode_body(request, TeamSpec)
    _, teams = await gw.tenants.read()
    record = await gw.tenants.put_team(team_id, spec)
    await gw.tenants.reload()
    created = team_id not in {t.id for t in teams}
    log.info("gateway.admin", action="put_team", team=team_id, created=created)
    return _json({"team": msgspec.structs.asdict(record), "created": created}, 201 if created else 200)


@delete("/admin/teams/{team_id:str}", status_code=200, **admin(
    404, 409, why={404: "No team has this id", 409: "The team still has keys: move or delete them first"}))
async def delete_team(request: Request, state: State, team_id: str) -> Response:
    gw = gw_of(state)
    keys, _ = await gw.tenants.read()
    if users := sorted(k.id for k in keys if k.team == team_id):
        conflict = InvalidRequest(f"Team `{team_id}` still has keys ({', '.join(users)}): move or delete them "
                                  "first.", param="id", code="team_in_use")
        conflict.status = 409
        raise conflict
    if not await gw.tenants.delete("team", team_id):
        raise NotFound(f"No team `{team_id}`.", param="id", code="team_not_found")
    await gw.tenants.reload()
    log.info("gateway.admin", action="delete_team", team=team_id)
    return _json({"id": team_id, "deleted": True})


@get("/admin/usage", **admin(400, params={
    "day": ("query", {"type": "string", "format": "date", "pattern": DAY_RE},
            "The last UTC day (YYYY-MM-DD); today when absent"),
    "days": ("query", {"type": "integer", "minimum": 1, "maximum": 35}, "Days back from `day` (usage is kept 35)"),
    "key": ("query", {"type": "string"}, "Only this key's usage"),
    "model": ("query", {"type": "string"}, "Only this model's usage")}))
async def usage(request: Request, state: State) -> Response:
    """Usage per key and model and UTC day: requests, input and output tokens, errors."""
    gw = gw_of(state)
    q = request.query_params
    try:
        if "day" in q and not re.fullmatch(DAY_RE, q["day"]):
            raise ValueError(q["day"])
        day = parse_day(q["day"]) if "day" in q else dt.datetime.now(dt.UTC).date().isoformat()
        days = int(q.get("days", "1"))
    except ValueError:
        raise InvalidRequest("`day` is YYYY-MM-DD and `days` a number of days.", param="day") from None
    if not 1 <= days <= 35:
        raise InvalidRequest("`days` must be 1 to 35 (usage is kept 35 days).", param="days")
    last = dt.date.fromisoformat(day)
    span = days_back(min(days, (last - dt.date.min).days + 1), last)  # none before year 1
    records = await read_usage(gw.tenants.redis, gw.tenants.keys, span, q.get("key") or None,
                               q.get("model") or None)
    return _json({"data": records, "totals": totals(records), "days": span})


HANDLERS: list[Any] = [list_keys, put_key, delete_key, list_teams, put_team, delete_team, usage]
