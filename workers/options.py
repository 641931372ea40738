"""What an agent is told: its worker, engine, Redis, heartbeat, drain and probe settings
(`python -m workers` builds them from flags), and the default worker id."""

from __future__ import annotations

import socket

import msgspec

from fleetgate.registry import DEFAULT_HEARTBEAT_TTL_S, DEFAULT_PREFIX
from workers.engines import EngineSpec


class AgentOptions(msgspec.Struct, kw_only=True):
    worker_id: str
    engine: str
    spec: EngineSpec
    # False for `--engine external`: the engine is someone else's; attach, never start or stop.
    managed: bool = True
    url: str = ""
    # An attached engine's KV cache events (its --kv-events-config endpoint, replay endpoint
    # and topic): the agent subscribes and publishes the index. "": none.
    kv_events: str = ""
    kv_replay: str = ""
    kv_topic: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = DEFAULT_PREFIX
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    health_timeout_s: float = 900.0
    drain_grace_s: float = 60.0
    warmup: bool = True
    warmup_attempts: int = 3
    engine_log: str | None = None
    # The card's speed as declared (--speed), pinned; 0: measured while the engine serves,
    # seeded by its profile, else by a probe batch timed at start.
    speed: float = 0.0
    # Each probe of the engine (metrics or health) gives up after this long; this many
    # failures in a row make the engine unhealthy (out of routing) until one passes.
    probe_timeout_s: float = 1.0
    unhealthy_after: int = 3
    # An external engine that fails this many probes in a row (over at least as many
    # heartbeat intervals) counts as dead.
    max_missed_scrapes: int = 5
    # How often the engine's model list is re-read (adapters loaded or unloaded at runtime).
    rediscover_s: float = 5.0

    @property
    def base_url(self) -> str:
        return self.url or f"http://{self.spec.host}:{self.spec.port}"


def default_worker_id(engine: str, port: int, gpu: str = "") -> str:
    host = socket.gethostname().split(".")[0]
    gpu_part = f"-gpu{gpu.replace(',', '_')}" if gpu else ""
    return f"{host}{gpu_part}-{engine}-{port}"


__all__ = ["AgentOptions", "default_worker_id"]
