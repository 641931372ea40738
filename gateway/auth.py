"""Client API keys: kept and compared as SHA-256 digests, logged only as a short key id."""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Sequence

from gateway.errors import Unauthorized


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def check_api_key(digests: frozenset[bytes], authorization: str) -> str:
    """Check an `Authorization` header against the configured keys (none configured: open).

    Returns a key id for logs (a digest prefix, never the key)."""
    if not digests:
        return ""
    scheme, _, token = authorization.partition(" ")
    key_digest = digest(token.strip() if scheme.lower() == "bearer" else "")
    if key_digest not in digests:
        raise Unauthorized("Missing or invalid API key: send `Authorization: Bearer <key>`.")
    return key_digest[:4].hex()


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
