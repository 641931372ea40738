"""Opening a Redis client from a URL: standalone, TLS, Unix socket, Sentinel or Cluster."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import EqualJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """Open an asyncio Redis client for ``url``.

    ``redis://``, ``rediss://`` and ``unix://`` as redis-py reads them; Sentinel as
    ``redis+sentinel://[:password@]host1:26379,host2:26379/<master name>[/<db>]``: the
    client asks the sentinels for the current master and follows a failover; Redis
    Cluster as ``redis+cluster://[:password@]host1:7000,host2:7001`` (any reachable nodes:
    the client learns the rest and follows slot moves and failovers). Every key lives in
    one slot (the prefix is a hash tag), so a cluster gives failover, not sharding.

    A command that finds its pooled connection dead (Redis restarted, a proxy or a failover
    closed it) is sent once more on a new connection: without it, the first command on each
    pooled connection after a restart failed (redis-py's `from_url` pools retry nothing).
    Only a closed or refused connection is retried, not a timeout, which may have run.
    """
    kwargs.setdefault("socket_connect_timeout", 2.0)
    kwargs.setdefault("socket_timeout", 5.0)
    kwargs.setdefault("health_check_interval", 10)
    if url.startswith("redis+cluster://"):
        return _cluster(url, **kwargs)  # (the cluster client retries moved slots and dead nodes itself)
    kwargs.setdefault("retry", once_more())
    if url.startswith("redis+sentinel://"):
        return _sentinel_master(url, **kwargs)
    return aioredis.from_url(url, **kwargs)


def once_more() -> Retry:
    """One retry, after 10-50 ms, of a command whose connection was closed or refused."""
    return Retry(EqualJitterBackoff(cap=0.05, base=0.01), 1, supported_errors=(RedisConnectionError,))


def _nodes(url: str, scheme: str, default_port: int) -> tuple[str | None, list[tuple[str, int]], list[str]]:
    """`scheme[:password@]host:port,host:port[/a/b]` -> (password, [(host, port)], [a, b])."""
    rest = url.removeprefix(scheme)
    password = None
    if "@" in rest:
        auth, rest = rest.rsplit("@", 1)
        password = auth.partition(":")[2] or None
    hosts, _, path = rest.partition("/")
    nodes = []
    for node in hosts.split(","):
        host, _, port = node.rpartition(":")
        nodes.append((host or node, int(port) if port.isdigit() else default_port))
    return password, nodes, [p for p in path.split("/") if p]


def _sentinel_master(url: str, **kwargs: Any) -> aioredis.Redis:
    from redis.asyncio.sentinel import Sentinel

    password, nodes, parts = _nodes(url, "redis+sentinel://", 26379)
    if not parts:
        raise ValueError("a Sentinel URL names the master: redis+sentinel://host:26379/<master>[/<db>]")
    db = int(parts[1]) if len(parts) > 1 else 0
    # The sentinels are asked about once a second (fleetgate/sentinel.py): bound every wait.
    timeouts = {k: kwargs[k] for k in ("socket_timeout", "socket_connect_timeout") if k in kwargs}
    sentinel = Sentinel(nodes, sentinel_kwargs={**timeouts, **({"password": password} if password else {})})
    return sentinel.master_for(parts[0], db=db, password=password, **kwargs)


def _cluster(url: str, **kwargs: Any) -> aioredis.Redis:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    password, nodes, parts = _nodes(url, "redis+cluster://", 6379)
    if parts not in ([], ["0"]):
        raise ValueError("Redis Cluster has only database 0: redis+cluster://host:7000,host:7001")
    # A cluster client is not a Redis subclass, but offers every command the registry uses.
    return RedisCluster(  # type: ignore[return-value]
        startup_nodes=[ClusterNode(host, port) for host, port in nodes], password=password, **kwargs
    )
