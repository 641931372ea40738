"""What an agent runs for its engine's KV cache events: two loopback ports, the flag that
makes the engine publish on them, the subscriber (workers/kv_events.py) and the Redis writer
(fleetgate/kv_registry.py), as two background tasks.

The agent binds the event socket on 127.0.0.1 and the engine connects to it (vLLM connects
its PUB socket to an endpoint without a wildcard); the engine binds its replay socket on
127.0.0.1. Nothing listens beyond the host: the events carry the prompts' token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import redis.asyncio as aioredis

from fleetgate.background import stop_tasks
from fleetgate.keys import DEFAULT_PREFIX
from fleetgate.kv_index import BlockIndex
from fleetgate.kv_registry import DEFAULT_KV_TTL_S, KvIndexWriter
from fleetgate.net import free_port
from workers.kv_events import KvEventSubscriber

__all__ = ["AgentKvEvents"]


class AgentKvEvents:
    """For an engine the agent starts, `AgentKvEvents(worker_id)` picks the ports and
    `engine_config()` is the flag to start it with. For an engine someone else started with
    its own `--kv-events-config` (`--engine external`), `attached=(endpoint, replay, topic)`:
    the engine binds (vLLM does for an endpoint with a wildcard, `tcp://*:5557`) and the agent
    connects."""

    def __init__(
        self, worker_id: str, *, host: str = "127.0.0.1", silence_s: float = 1.0,
        attached: tuple[str, str, str] | None = None,
    ) -> None:  # fmt: skip
        self.worker_id = worker_id
        if attached is None:
            self.topic = f"kv@{worker_id}"
            self.endpoint = f"tcp://{host}:{free_port(host)}"
            self.replay_endpoint = f"tcp://{host}:{free_port(host)}"
        else:
            self.endpoint, self.replay_endpoint, self.topic = attached
        self.index = BlockIndex()
        self.subscriber = KvEventSubscriber(
            self.endpoint, replay_endpoint=self.replay_endpoint or None, topic=self.topic,
            bind=attached is None, index=self.index, silence_s=silence_s, name=worker_id,
        )  # fmt: skip
        self.writer: KvIndexWriter | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def engine_config(self) -> str:
        """The value of the engine's `--kv-events-config` (vLLM's JSON; the simulator's too)."""
        return json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint, "topic": self.topic,
        })  # fmt: skip

    def start(
        self, redis: aioredis.Redis, prefix: str = DEFAULT_PREFIX, ttl_s: float = DEFAULT_KV_TTL_S
    ) -> None:
        """Subscribe and publish the index, in the background (call before the engine starts,
        so that its first batch finds the socket bound; a late start is replayed anyway)."""
        self.writer = KvIndexWriter(redis, self.worker_id, self.index, self.subscriber,
                                    prefix=prefix, ttl_s=ttl_s)  # fmt: skip
        self._tasks = [
            asyncio.create_task(self.subscriber.run(), name="kv-events"),
            asyncio.create_task(self.writer.run(), name="kv-index-writer"),
        ]

    def note_block_size(self, block_size: int) -> None:
        """The engine's block size from its metrics, before any block is stored: a gateway
        can then tell an empty cache from an unknown one."""
        if block_size and not self.index.block_size:
            self.index.block_size = block_size

    async def aclose(self, remove: bool = True) -> None:
        # Cancelled again each second: a cancel lost in pyzmq's poll once left an agent whose
        # warm-up had failed waiting here, never deregistering or exiting (tests/e2e/test_agent.py).
        await stop_tasks(*self._tasks, again_after_s=1.0)
        self._tasks = []
        if remove and self.writer is not None:
            with contextlib.suppress(aioredis.RedisError, OSError):
                await self.writer.remove()
