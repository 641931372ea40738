"""Checks a spawner runs before it detaches an agent: mistakes that would otherwise only
show as an agent looping quietly in the background.

    Redis answers PING at --redis-url (Sentinel and Cluster URLs as the agent reads them)
    the host gateways will be told to reach the engine at (--advertise-host, else --host;
    --url's for an external engine) resolves
"""

from __future__ import annotations

import asyncio
import re
import socket
from urllib.parse import urlsplit

from fleetgate.registry import connect


def redacted(url: str) -> str:
    """The URL without its password."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


async def _ping(url: str, timeout_s: float) -> None:
    redis = connect(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        await asyncio.wait_for(redis.ping(), timeout_s * 2)  # type: ignore[misc]
    finally:
        await redis.aclose()


def check_redis(url: str, timeout_s: float = 3.0) -> str | None:
    """None when Redis answers, else what is wrong and what to check."""
    try:
        asyncio.run(_ping(url, timeout_s))
    except Exception as exc:
        reason = str(exc) or type(exc).__name__
        return (f"cannot reach Redis at {redacted(url)} ({reason}): is it running, and reachable "
                "from this host? check --redis-url / FLEETGATE_REDIS_URL.")
    return None


def check_host(url: str) -> str | None:
    """None when the host of `url` (where gateways will reach the engine) resolves."""
    host = urlsplit(url).hostname or ""
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        return (f"the engine's address {url} does not resolve ({host!r}: {reason}): "
                "gateways could not reach it. Check --advertise-host (or --host, or --url).")
    return None
