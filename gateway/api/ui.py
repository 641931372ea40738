"""The operators' dashboard at `/admin/ui`, and the admin reads it polls.

A browser cannot send a bearer header when it navigates, so the admin token is
given once (the login form, or `?token=` in a bookmark) and exchanged for an
HttpOnly, SameSite=Strict cookie scoped to `/admin`. The cookie carries no token,
only an expiry and an HMAC of it keyed by the token: any gateway of the fleet that
shares the token accepts it, and changing the token logs every browser out.

Cross-site request forgery: a SameSite=Strict cookie is not sent on requests that
start on another site, and admin writes authorised by the cookie also need the
`x-fleetgate-csrf` header, which a cross-origin page cannot add without a CORS
preflight that the gateway never grants. Pages forbid framing and inline script.

The page is rendered here; `ui_assets/dashboard.js` (no framework, no CDN) refreshes
it from `/admin/workers`, `/admin/stats`, `/admin/decisions` and `/admin/usage` every 1.5 s.
"""

from __future__ import annotations

import hmac
import html
import time
from importlib import resources
from typing import Any

from litestar import Request, Response, get, post
from litestar.datastructures import Cookie, State
from litestar.response import Redirect

from fleetgate.schema import WorkerView
from gateway.errors import NotFound
from gateway.state import Gateway, gw_of
from gateway.tenants.auth import COOKIE, SESSION_S, session_ok, session_value

_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
_PAGE_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "x-content-type-options": "nosniff",
}


def _cookie(request: Request, value: str, max_age: int) -> Cookie:
    https = request.url.scheme == "https" or request.headers.get("x-forwarded-proto") == "https"
    return Cookie(
        key=COOKIE, value=value, path="/admin", max_age=max_age, httponly=True,
        samesite="strict", secure=https,
    )


# -- pages ----------------------------------------------------------------------------


def _page(title: str, body: str, status: int = 200, cookies: list[Cookie] | None = None) -> Response:
    doc = (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title>"
        '<link rel=stylesheet href="/admin/ui/assets/dashboard.css"></head>'
        f"<body>{body}</body></html>"
    )
    return Response(
        content=doc, status_code=status, media_type="text/html; charset=utf-8",
        headers=_PAGE_HEADERS, cookies=cookies or [],
    )


def _login_page(error: str = "", status: int = 200) -> Response:
    note = f'<p class=error role=alert>{html.escape(error)}</p>' if error else ""
    return _page("fleetgate: sign in", (
        "<main class=login><h1>fleetgate</h1>"
        "<form method=post action=/admin/ui/login>"
        "<label for=token>Admin token</label>"
        "<input id=token name=token type=password autocomplete=current-password autofocus required>"
        f"<button type=submit>Sign in</button>{note}</form>"
        "<p class=hint>The gateway's <code>FLEETGATE_ADMIN_TOKEN</code>.</p></main>"
    ), status)


def _signed_in(request: Request, token: str) -> Response:
    # 303: the browser follows with a GET, and the token leaves the address bar.
    return Redirect(
        "/admin/ui", status_code=303, cookies=[_cookie(request, session_value(token), SESSION_S)],
        headers={"cache-control": "no-store", "referrer-policy": "no-referrer"},
    )


def _cell(text: object, cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    return f"<td{attr}>{html.escape(str(text))}</td>"


def speed_text(speed: float, source: str) -> str:
    return f"x{speed:.2f} {source}".rstrip()


def _speed_cell(w: WorkerView) -> str:
    """The speed routing weighs the worker by and where it came from; the start-up figure
    that seeded it in the tooltip."""
    start = html.escape(speed_text(w.info.speed, w.info.speed_source), quote=True)
    return (f'<td class=num title="at start: {start}">'
            f"{html.escape(speed_text(w.speed, w.speed_source))}</td>")


def _row(w: WorkerView, inflight: int) -> str:
    info, load = w.info, w.load
    gpu = info.gpu
    gpu_text = (f"{gpu.name} ({gpu.memory_mib // 1024} GiB)" if gpu.memory_mib else gpu.name) if gpu else ""
    state = w.effective_state
    age = f"{time.time() - w.last_heartbeat:.1f} s" if w.last_heartbeat else "-"
    wid = html.escape(info.id, quote=True)
    toggle = "undrain" if w.admin_drain else "drain"
    return (
        f'<tr data-worker="{wid}">'
        f'<td><span class=wid>{wid}</span><span class=url>{html.escape(info.url)}</span></td>'
        + _cell(info.host) + _cell(gpu_text) + _cell(info.engine) + _cell(info.model)
        + _cell(", ".join(info.adapters) or "-")
        + f'<td><span class="state state-{html.escape(state)}">{html.escape(state)}</span></td>'
        + _cell("-", "col-circuit")
        + _cell(f"{load.running} / {load.waiting}", "num")
        + _cell(f"{load.kv_cache_usage * 100:.0f}%", "num")
        + _speed_cell(w)
        + _cell(inflight, "num") + _cell("-", "num") + _cell(age, "num")
        + f'<td class=actions><button type=button data-action="{toggle}" data-worker="{wid}">'
        f'{toggle.capitalize()}</button>'
        f'<button type=button class=danger data-action=remove data-worker="{wid}">Remove</button></td>'
        "</tr>"
    )


_COLUMNS = (
    "Worker", "Host", "GPU", "Engine", "Model", "Adapters", "State", "Circuit", "Run / wait",
    "KV", "Speed", "In flight", "Req/s", "Heartbeat", "",
)


def _dashboard(gw: Gateway) -> Response:
    snapshot = gw.watcher.snapshot
    inflight = gw.proxy.inflight
    rows = "".join(_row(w, inflight.get(w.id, 0)) for w in snapshot.workers)
    empty = "" if rows else '<tr class=empty><td colspan=15>No workers registered.</td></tr>'
    head = "".join(
        f'<th class="{"col-circuit" if c == "Circuit" else ""}">{html.escape(c)}</th>' for c in _COLUMNS
    )
    registry = "degraded" if gw.watcher.degraded else "ok"
    return _page("fleetgate", (
        "<header><h1>fleetgate</h1>"
        f'<span id=registry class="pill pill-{registry}">registry {registry}</span>'
        f'<span id=summary>{len(snapshot.workers)} workers</span>'
        '<span id=live class=live>live</span>'
        "<form method=post action=/admin/ui/logout><button type=submit class=link>Sign out</button></form>"
        "</header><main>"
        '<section id=totals class=totals aria-label="gateway totals"></section>'
        '<h2>Workers</h2><div class=scroll><table id=workers class="no-circuit">'
        f"<thead><tr>{head}</tr></thead><tbody>{rows or empty}</tbody></table></div>"
        "<h2>Recent routing decisions <small>(this gateway)</small></h2>"
        '<div class=scroll><table id=decisions><thead><tr><th>Time</th><th>Request</th><th>Model</th>'
        "<th>Worker</th><th>Reason</th><th>Attempts</th><th>Status</th></tr></thead>"
        '<tbody><tr class=empty><td colspan=7>No requests yet.</td></tr></tbody></table></div>'
        "<h2>Usage today <small>(per key and model, every replica)</small></h2>"
        '<div class=scroll><table id=usage><thead><tr><th>Key</th><th>Model</th><th>Requests</th>'
        "<th>Input tokens</th><th>Output tokens</th><th>Errors</th><th>Rate-limited</th></tr></thead>"
        '<tbody><tr class=empty><td colspan=7>No usage yet.</td></tr></tbody></table></div>'
        '<div id=toast role=status aria-live=polite></div>'
        '<dialog id=confirm><form method=dialog><p id=confirm-text></p><menu>'
        '<button value=cancel id=confirm-cancel>Cancel</button>'
        '<button value=ok id=confirm-ok class=danger>Confirm</button></menu></form></dialog>'
        '</main><script src="/admin/ui/assets/dashboard.js"></script>'
    ))


@get("/admin/ui", include_in_schema=False)
async def ui_page(request: Request, state: State) -> Response:
    gw = gw_of(state)
    token = gw.settings.admin_token
    if not token:
        return _login_page("No admin token is configured on this gateway (FLEETGATE_ADMIN_TOKEN).", 503)
    given = request.query_params.get("token")
    if given is not None:
        if hmac.compare_digest(given.encode(), token.encode()):
            return _signed_in(request, token)
        return _login_page("That token is not this gateway's admin token.", 401)
    if not session_ok(token, request.cookies.get(COOKIE, "")):
        return _login_page()
    return _dashboard(gw)


@post("/admin/ui/login", status_code=303, include_in_schema=False)
async def ui_login(request: Request, state: State) -> Response:
    token = gw_of(state).settings.admin_token
    form = await request.form()
    given = str(form.get("token", ""))
    if token and hmac.compare_digest(given.encode(), token.encode()):
        return _signed_in(request, token)
    return _login_page("That token is not this gateway's admin token.", 401)


@post("/admin/ui/logout", status_code=303, include_in_schema=False)
async def ui_logout(request: Request) -> Response:
    return Redirect("/admin/ui", status_code=303, cookies=[_cookie(request, "", 0)])


def _asset(name: str) -> bytes:
    return (resources.files("gateway.api") / "ui_assets" / name).read_bytes()


@get("/admin/ui/assets/{name:str}", include_in_schema=False)
async def ui_asset(name: str) -> Response:
    """The page's script and stylesheet (not secret: served without a session)."""
    if name not in _ASSETS:
        raise NotFound(f"No asset `{name}`.")
    return Response(
        content=_asset(name), media_type=_ASSETS[name],
        headers={"cache-control": "no-cache", "x-content-type-options": "nosniff"},
    )


HANDLERS: list[Any] = [ui_page, ui_login, ui_logout, ui_asset]
