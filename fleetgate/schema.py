"""The fleet's records: what a worker is and how loaded it is.

These Structs are the typed edge between workers, the Redis registry and the
gateway. They are encoded as JSON with msgspec; `SCHEMA_VERSION` is bumped
whenever a field changes meaning, and readers skip records of another version.
"""

from __future__ import annotations

from typing import Literal

import msgspec

SCHEMA_VERSION = 1

WorkerState = Literal["starting", "ready", "draining"]


class GpuInfo(msgspec.Struct, kw_only=True, frozen=True):
    """The card an engine runs on, as nvidia-smi names it (or a simulated profile)."""

    name: str
    memory_mib: int = 0
    index: str = ""
    profile: str = ""


class WorkerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a worker serves. Written once at registration, rewritten when adapters change."""

    id: str
    url: str
    engine: str
    model: str
    adapters: tuple[str, ...] = ()
    max_model_len: int = 4096
    gpu: GpuInfo | None = None
    host: str = ""
    # Sequences the engine runs at once; the gateway normalises load by it.
    capacity: int = 256
    # How fast one of those sequences runs, relative to an H100-class card with a 7B model
    # (from the card's timing profile: a T4 is ~0.25). The gateway weighs load by
    # capacity x speed, so a small batch on a slow card is not mistaken for a fast one.
    speed: float = 1.0
    # Whether adapters can be loaded at runtime (vLLM yes, LMDeploy/ms-swift no).
    runtime_lora: bool = False
    max_loras: int = 0
    # Whether the engine continues a trailing assistant message by itself (LMDeploy, ms-swift)
    # or needs `continue_final_message` to (vLLM): how a cut stream is resumed on it. None:
    # a record from an agent older than the field.
    continues_trailing_assistant: bool | None = None
    # The model's tokenizer.json as an absolute path on the worker's host ("" when the agent
    # knows none: a model by name, a record from an agent older than the field). A gateway
    # that can read it counts prompt tokens exactly (gateway/request/tokenizers.py).
    tokenizer: str = ""
    # An embedding model (vLLM's pooling runner): it serves /v1/embeddings, not generation.
    pooling: bool = False
    # Whether the engine reports a queue through /metrics; without it the gateway's
    # own in-flight count is the only load signal.
    reports_load: bool = True
    # The engine's KV cache, in tokens (vLLM: num_gpu_blocks x block_size from
    # vllm:cache_config_info); 0 when unknown. The gateway sizes its model of each
    # worker's prefix cache by it.
    kv_tokens: int = 0
    block_size: int = 16
    # Where `speed` came from: "profile" (the card's timing profile), "declared"
    # (--speed), "measured" (a probe batch timed at start), "assumed" (1.0: nothing to
    # time, e.g. an embedding model; the agent warns); "" before the agent knows (while
    # starting) and for records written before this field existed. This is the start-up
    # figure: it seeds the running measurement (Load.speed) and sizes the affinity ring.
    speed_source: str = ""
    # How often the agent publishes the engine's load (its --heartbeat-interval); 0: an agent
    # older than the field (it heartbeats every second). The gateway judges a report's age by it.
    heartbeat_s: float = 0.0
    agent_pid: int = 0
    started_at: float = 0.0
    schema: int = SCHEMA_VERSION


class Load(msgspec.Struct, kw_only=True, frozen=True):
    """One scrape of an engine's load, published by the agent about once a second."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    # True when kv_cache_usage is the engine's own gauge from this scrape (False: the engine
    # exports none, or its metrics did not parse): only then does routing take it as the truth.
    kv_measured: bool = False
    prefix_cache_queries: float = 0.0
    prefix_cache_hits: float = 0.0
    preemptions: float = 0.0
    # Adapters with requests in the engine right now (vLLM's lora_requests_info).
    lora_active: tuple[str, ...] = ()
    # The engine's LoRA slots, the most adapters one batch can use (vLLM's `max_lora` label;
    # where the engine reports none, its launch arguments, or one per adapter for an engine
    # whose adapters are all loaded at start); 0: unknown. The gateway places adapters by it.
    lora_slots: int = 0
    # The adapters of the engine's running and of its waiting requests, as its report names
    # them (vLLM 0.32 lists every adapter with a request in both: only their union is sure).
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    # Waiting requests the engine's scheduler skipped this step (vLLM's
    # num_requests_waiting_by_reason{reason="deferred"}): mostly requests whose adapter found
    # every LoRA slot busy with others.
    deferred: int = 0
    # Why the agent's probes find the engine unhealthy (hung, refusing, failing); "" while
    # healthy. The figures above are then the last good scrape's.
    unhealthy: str = ""
    ts: float = 0.0
    # The worker's speed as the agent measures it while the engine serves (same scale as
    # WorkerInfo.speed, workers/speedometer.py); the gateway weighs load by it. 0.0: not
    # reported (an agent older than the field): WorkerInfo.speed stands.
    speed: float = 0.0
    # Where `speed` comes from: "engine" (measured from the engine's own counters), or,
    # until the first measurement (or for an engine without counters, or a --speed the
    # operator pinned), the start-up figure's WorkerInfo.speed_source.
    speed_source: str = ""


class WorkerView(msgspec.Struct, kw_only=True, frozen=True):
    """A worker as the gateway sees it: its record, state and latest load."""

    info: WorkerInfo
    state: WorkerState
    load: Load = Load()
    last_heartbeat: float = 0.0
    # Set by an operator through the admin API; independent of the agent's state so
    # that the agent's own writes never clear it.
    admin_drain: bool = False
    # stable_hash(id), computed once when the record is read; rendezvous hashing uses it.
    id_hash: int = 0
    # Why a gateway's circuit breaker took this worker out of routing ("" when closed).
    circuit: str = ""

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def speed(self) -> float:
        """The speed routing weighs the worker by: the agent's running measurement, else
        (an agent older than it) the start-up figure."""
        return self.load.speed if self.load.speed > 0 else self.info.speed

    @property
    def speed_source(self) -> str:
        return self.load.speed_source if self.load.speed > 0 else self.info.speed_source

    @property
    def draining(self) -> bool:
        return self.admin_drain or self.state == "draining"

    @property
    def unhealthy(self) -> bool:
        return bool(self.load.unhealthy)

    @property
    def effective_state(self) -> str:
        if self.draining:
            return "draining"
        return "unhealthy" if self.unhealthy and self.state == "ready" else self.state

    @property
    def routable(self) -> bool:
        return self.state == "ready" and not self.admin_drain and not self.circuit and not self.unhealthy

    def serves(self, model: str) -> bool:
        return model == self.info.model or model in self.info.adapters
