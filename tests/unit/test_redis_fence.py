"""The redis-py internals fleetgate/sentinel.py relies on, named one by one: `follow_master` closes
the connections of a Sentinel pool that are not on the sentinels' master, and redis-py keeps no
public list of a pool's connections. redis is pinned to the tested minor version in
pyproject.toml; a release that renames or reshapes these fails here, loudly."""

from __future__ import annotations

import redis
from redis.asyncio.connection import Connection
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from fleetgate.sentinel import _connections

TESTED = "8.1."


def test_the_tested_minor_is_installed() -> None:
    assert redis.__version__.startswith(TESTED), (
        f"redis {redis.__version__}: fleetgate/sentinel.py was tested with {TESTED}x; check its "
        "use of the pool's connection lists, then move the pin in pyproject.toml and TESTED here")


async def test_a_sentinel_pools_connections_are_listed_where_sentinel_py_reads_them() -> None:
    sentinel = Sentinel([("127.0.0.1", 1)])
    pool = SentinelConnectionPool("mymaster", sentinel)
    # Both lists exist on a new pool, and a connection taken out moves between them.
    assert isinstance(pool._available_connections, list)
    assert isinstance(pool._in_use_connections, set)
    assert _connections(pool) == []
    conn = Connection(host="127.0.0.1", port=1)
    pool._available_connections.append(conn)
    assert _connections(pool) == [conn]
    # What follow_master reads of a connection: where it points, whether it is open.
    assert (conn.host, conn.port) == ("127.0.0.1", 1)
    assert conn.is_connected is False
    await pool.disconnect()
