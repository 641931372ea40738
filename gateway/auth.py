"""Client API keys: kept and compared as SHA-256 digests, logged only as a short key id."""

from __future__ import annotations

import hashlib

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
