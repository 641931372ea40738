"""Following a Sentinel-managed master when it moves while the old one is still up.

redis-py asks the sentinels for the master's address only when it opens a connection: a
master that dies breaks every connection, so the next command finds the promoted replica.
But after an operator's switchover (`SENTINEL FAILOVER`), or a failover around a master
that was cut off rather than dead, the old master keeps its clients, still accepts their
writes for seconds (until the sentinels turn it into a replica, which then discards them),
and every reader on it sees a registry nobody else writes to any more. So gateways and
agents call `follow_master` about once a second: it asks the sentinels, and when their
master is not the one the pool is connected to, closes every connection of the pool (idle
and in use, pub/sub included); each reconnects, through the sentinels, to the new master.
A connection can still reach the old master after that: one whose connect began before the
move and ended after it, or a command retried on a sentinel that had not yet learnt of the
promotion (the sentinels agree only a second or two later). On a loaded machine that is
common (clients of a few busy tasks each kept one or two in 11 of 13 switchovers), so
every call also closes any connection that is not on the sentinels' master.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# The attribute of a pool that holds the master `follow_master` last saw there.
_SEEN = "_fleetgate_master_seen"


async def follow_master(redis: Any, timeout_s: float = 2.0) -> str:
    """"host:port" of the new master when it moved since the client's last connection, or
    when some connection is on another server (those are then closed, to reconnect there);
    "" otherwise, for a client that is not
    Sentinel-managed, or when no sentinel answers within `timeout_s` (nothing to learn: the
    commands' own errors say whether Redis is reachable)."""
    pool = getattr(redis, "connection_pool", None)
    if not isinstance(pool, SentinelConnectionPool) or not pool.is_master:
        return ""
    # The master this function last saw, not pool.master_address alone: any new connection
    # of the pool (a reconnecting pub/sub, a busy moment) updates that one silently, and
    # the connections still on the old master would then never be closed.
    before = getattr(pool, _SEEN, None) or pool.master_address
    if before is None:  # not connected yet: the first connection asks the sentinels anyway
        return ""
    try:
        # Updates pool.master_address and closes the idle connections when it changed.
        async with asyncio.timeout(timeout_s):
            now = await pool.get_master_address()
    except (ConnectionError, RedisTimeoutError, TimeoutError):
        return ""
    setattr(pool, _SEEN, now)
    if now == before:
        # Nothing moved, as the sentinels tell it; but a connection may have reached the old
        # master after the move (module docstring): close those, and only those.
        late = [c for c in _connections(pool) if c.is_connected and (c.host, c.port) != now]
        if not late:
            return ""
        await asyncio.gather(*(c.disconnect() for c in late), return_exceptions=True)
    else:
        # In-use connections too: released later, they would go back to the pool still
        # connected to the old master. A command on one fails and is retried on a new connection.
        await pool.disconnect(inuse_connections=True)
    host, port = now
    return f"{host}:{port}"


def _connections(pool: SentinelConnectionPool) -> list[Any]:
    """Every connection of the pool, idle and in use (redis-py keeps no public list)."""
    return [*pool._available_connections, *pool._in_use_connections]
