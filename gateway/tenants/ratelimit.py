"""Per-client request limits on the inference routes, shared by every gateway replica.

A client is its API key (by key id, never the key) or, on an open data plane, its
address. The count lives in Redis (`Registry.take`, a GCRA cell: one key per client,
Redis's clock), so N replicas enforce one limit, not N. If Redis cannot answer, requests
pass: a limiter that fails closed would turn a registry outage into a full outage.
"""

from __future__ import annotations

import structlog
from redis.exceptions import RedisError

from fleetgate.registry import Registry
from gateway.errors import RateLimited

log = structlog.get_logger("gateway.ratelimit")


class RateLimiter:
    def __init__(self, registry: Registry, per_minute: float, burst: int = 0) -> None:
        self.registry = registry
        self.per_minute = per_minute
        # Default burst: ten seconds' worth of requests.
        self.burst = burst if burst > 0 else max(1, round(per_minute / 6))
        self._unavailable = False

    async def admit(self, key_id: str, address: str | None) -> list[tuple[str, str]]:
        """Count one request of the client (its API key's id, else its address); the
        answer's `x-ratelimit-*` headers (none when limits are off), or RateLimited."""
        if self.per_minute <= 0:
            return []
        client_id = f"key:{key_id}" if key_id else f"addr:{address or 'unknown'}"
        try:
            allowed, remaining, wait_s = await self.registry.take(client_id, self.per_minute, self.burst)
        except (RedisError, OSError) as exc:
            if not self._unavailable:
                log.warning("gateway.rate_limit_unavailable", error=repr(exc))
            self._unavailable = True
            return []
        self._unavailable = False
        # Until the client has its whole burst back.
        reset_s = (self.burst - remaining) * 60.0 / self.per_minute
        headers = [
            ("x-ratelimit-limit-requests", f"{self.per_minute:g}"),
            ("x-ratelimit-remaining-requests", str(remaining)),
            ("x-ratelimit-reset-requests", f"{reset_s:.3g}s"),
        ]
        if not allowed:
            log.info("gateway.rate_limited", client=client_id, retry_after_s=round(wait_s, 3))
            raise RateLimited(
                f"Rate limit reached: {self.per_minute:g} requests per minute for this client "
                f"(bursts of {self.burst}). Try again in {wait_s:.2g} s.",
                retry_after=wait_s, limit_headers=dict(headers),
            )
        return headers

