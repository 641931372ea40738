"""Who may call what: client API keys, and the admin token or the dashboard's session cookie.

API keys are kept and compared as SHA-256 digests, logged only as a short key id.

The admin session (see `gateway/api/ui.py` for the browser side): the cookie carries no token,
only an expiry and an HMAC of it keyed by the token, so any gateway of the fleet that shares
the token accepts it, and changing the token logs every browser out.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import time
from collections.abc import Sequence
from typing import Any

from litestar.connection import ASGIConnection

from gateway.errors import Unauthorized

COOKIE = "fleetgate_admin"
CSRF_HEADER = "x-fleetgate-csrf"
SESSION_S = 12 * 3600


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost; a host name may resolve to anything, so it is not."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_data_plane(host: str, api_keys: Sequence[str]) -> str | None:
    """A warning when /v1 takes requests from beyond this machine with no API key at all."""
    if api_keys or is_loopback(host):
        return None
    return (f"The OpenAI API (/v1) is open: the gateway listens on {host}, beyond loopback, and no "
            "API keys are set, so anyone who can reach it can use the fleet. Set FLEETGATE_API_KEYS "
            "(or bind to 127.0.0.1 behind a proxy that authenticates).")


# -- admin ---------------------------------------------------------------------------


def _sign(token: str, expires: int) -> str:
    return hmac.new(token.encode(), f"fleetgate-ui:{expires}".encode(), hashlib.sha256).hexdigest()


def session_value(token: str, now: float | None = None) -> str:
    expires = int((time.time() if now is None else now) + SESSION_S)
    return f"{expires}.{_sign(token, expires)}"


def session_ok(token: str, value: str, now: float | None = None) -> bool:
    expires, _, mac = value.partition(".")
    if not token or not expires.isdigit() or int(expires) < (time.time() if now is None else now):
        return False
    return hmac.compare_digest(mac.encode(), _sign(token, int(expires)).encode())


def _bearer_ok(request: ASGIConnection[Any, Any, Any, Any], token: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def admin_authorized(request: ASGIConnection[Any, Any, Any, Any], token: str) -> bool:
    """A bearer token, or the dashboard's cookie (plus the CSRF header on writes)."""
    if not token:
        return False
    if _bearer_ok(request, token):
        return True
    if not session_ok(token, request.cookies.get(COOKIE, "")):
        return False
    return request.scope.get("method") in ("GET", "HEAD") or request.headers.get(CSRF_HEADER) == "1"


def check_admin(request: ASGIConnection[Any, Any, Any, Any], token: str) -> None:
    """Raise `Unauthorized` unless the request carries the admin token or a valid session."""
    if not admin_authorized(request, token):
        raise Unauthorized(
            "Admin endpoints need `Authorization: Bearer <FLEETGATE_ADMIN_TOKEN>`"
            + ("" if token else " (no admin token is configured on this gateway)."),
        )


def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: object) -> None:
    """The Litestar guard on every admin API route (gateway/app.py's admin router): the admin
    token, or the dashboard's session (with the CSRF header on writes); else a 401."""
    check_admin(connection, connection.app.state["gw"].settings.admin_token)
