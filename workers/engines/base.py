"""The engine protocol: everything the agent needs to know about an inference engine.

An engine is one file in this package with one class that satisfies `Engine`.
The agent never branches on an engine's name; it builds the command line, polls
the health path, scrapes and parses metrics, and loads adapters through this
interface only.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Protocol

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.schema import GpuInfo, Load


class EngineSpec(msgspec.Struct, kw_only=True):
    """What to run: the same for every engine; `options` carries engine-specific tuning."""

    model: str
    served_name: str
    port: int
    host: str = "127.0.0.1"
    max_model_len: int = 4096
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    gpu: GpuInfo | None = None
    gpu_ids: tuple[str, ...] = ()
    # Engine tuning from config/workers.yaml or flags, e.g. {"max_num_seqs": 256}.
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    # vLLM's --kv-events-config JSON, set by the agent for an engine that publishes KV cache
    # events (workers/kv_agent.py); "" for none.
    kv_events_config: str = ""


class KvCache(msgspec.Struct, kw_only=True, frozen=True):
    """The engine's KV cache as it reports it: `tokens` = blocks x block size (0: unknown)."""

    tokens: int = 0
    block_size: int = 0


class EngineWork(msgspec.Struct, kw_only=True, frozen=True):
    """What the engine has done since it started, from its own counters (cumulative, as
    Prometheus counts): the agent's speed measurement reads the differences between two
    scrapes (`workers/speedometer.py`). Zero where the engine does not count it.

    `latency_sum / latency_count` is the time between a sequence's consecutive tokens: one
    observation per token, each one engine step (vLLM's inter-token latency), or one per
    finished request, its mean time per output token (LMDeploy)."""

    generated: float = 0.0  # output tokens sampled
    prefilled: float = 0.0  # prompt tokens computed (prefix-cache hits not counted)
    steps: float = 0.0  # engine steps (0: the engine does not count them)
    latency_sum: float = 0.0
    latency_count: float = 0.0


class AdapterError(Exception):
    """An adapter could not be loaded or unloaded; `status` is the engine's HTTP status."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


class Engine(Protocol):
    name: ClassVar[str]
    # Whether adapters can be loaded and unloaded while the engine runs.
    runtime_lora: ClassVar[bool]
    # Whether /metrics reports running/waiting; if not, the gateway's in-flight count is the load.
    reports_load: ClassVar[bool]
    health_path: ClassVar[str]
    metrics_path: ClassVar[str | None]
    # The names `EngineSpec.options` may have for this engine.
    options: ClassVar[frozenset[str]]

    def command(self, spec: EngineSpec) -> list[str]:
        """The argv that starts the engine (the agent runs it in its own process group)."""
        ...

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        """Variables to add to the engine's environment."""
        ...

    def capacity(self, spec: EngineSpec) -> int:
        """How many sequences the engine runs at once (its batch size)."""
        ...

    def max_loras(self, spec: EngineSpec) -> int:
        """Adapter slots (0 when LoRA is off)."""
        ...

    def continues_trailing_assistant(self, spec: EngineSpec) -> bool:
        """Whether a chat whose last message is the assistant's is continued by the engine itself
        (True), or needs `continue_final_message: true, add_generation_prompt: false` to be
        (False: without them it starts a new reply after it). The gateway resumes cut streams
        by it."""
        ...

    def publishes_kv_events(self, spec: EngineSpec) -> bool:
        """Whether the engine publishes vLLM's KV cache events when `spec.kv_events_config`
        is set (it then passes it as `--kv-events-config`); engines that do not keep the
        gateway's approximate placement."""
        ...

    def parse_metrics(self, text: str) -> Load:
        """One load record from the engine's Prometheus text."""
        ...

    def parse_kv_cache(self, text: str) -> KvCache:
        """The KV cache's size from the engine's Prometheus text (KvCache() when it says none)."""
        ...

    def parse_work(self, text: str) -> EngineWork:
        """The engine's work counters from its Prometheus text (EngineWork() when it has none)."""
        ...

    async def load_adapter(
        self, client: httpx.AsyncClient, base_url: str, name: str, path: str
    ) -> None: ...

    async def runtime_lora_enabled(self, client: httpx.AsyncClient, base_url: str) -> bool:
        """Whether the running engine at `base_url` takes adapters at runtime (an engine
        attached from outside may have been started without its adapter API)."""
        ...

    async def unload_adapter(self, client: httpx.AsyncClient, base_url: str, name: str) -> None: ...


@functools.lru_cache(maxsize=1)
def metric_samples(text: str) -> dict[str, list[tuple[Mapping[str, str], float]]]:
    """Prometheus text as {sample name: [(labels, value), ...]} via prometheus_client's parser.

    The last page's answer is kept (read it, never change it): a scrape is parsed for its
    load and for its work counters, and parsing vLLM's page costs ~30 ms on a small CPU."""
    out: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(samples: Mapping[str, list[tuple[Mapping[str, str], float]]], *names: str) -> float:
    """Sum of the first of `names` present (later names are deprecated aliases)."""
    for name in names:
        if name in samples:
            return sum(value for _, value in samples[name])
    return 0.0


def histogram(
    samples: Mapping[str, list[tuple[Mapping[str, str], float]]], *names: str
) -> tuple[float, float]:
    """(sum, count) of the first histogram of `names` present, over all its series."""
    for name in names:
        if f"{name}_count" in samples:
            return total(samples, f"{name}_sum"), total(samples, f"{name}_count")
    return 0.0, 0.0


def peak(samples: Mapping[str, list[tuple[Mapping[str, str], float]]], *names: str) -> float:
    """Largest value of the first of `names` present."""
    for name in names:
        if name in samples:
            return max((value for _, value in samples[name]), default=0.0)
    return 0.0


def flag_args(options: Mapping[str, Any], known: Iterable[str]) -> list[str]:
    """`--flag value` pairs for the options an engine knows, in a stable order.

    True becomes a bare flag, False and None are left out; names use dashes.
    """
    argv: list[str] = []
    for key in known:
        value = options.get(key)
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        else:
            argv.extend([flag, str(value)])
    return argv


def pooling(spec: EngineSpec) -> bool:
    """An embedding model: vLLM's `--runner pooling`, or `--convert embed` (which implies it)."""
    return spec.options.get("runner") == "pooling" or spec.options.get("convert") == "embed"


def lora_enabled(spec: EngineSpec) -> bool:
    """LoRA is on when adapters are given at start or the profile asks for runtime loading."""
    return bool(spec.adapters) or bool(spec.options.get("enable_lora"))


def start_adapter_args(spec: EngineSpec) -> list[str]:
    """`--adapters name=path ...`: how LMDeploy and ms-swift take adapters at start."""
    if not spec.adapters:
        return []
    return ["--adapters", *(f"{name}={path}" for name, path in spec.adapters.items())]


class FixedAtStart:
    """What LMDeploy and ms-swift answer alike, serving only what they were started with: their
    adapters come as `--adapters name=path` (`start_adapter_args`) and all stay resident, with no
    runtime API to load or unload one; they publish no KV cache events, nor their cache's size
    (LMDeploy only its usage fraction). `label` names the engine in the refusals."""

    runtime_lora: ClassVar[bool] = False
    label: ClassVar[str]

    def max_loras(self, spec: EngineSpec) -> int:
        # Every start-time adapter stays resident; there are no other slots.
        return len(spec.adapters)

    def publishes_kv_events(self, spec: EngineSpec) -> bool:
        return False

    def parse_kv_cache(self, text: str) -> KvCache:
        return KvCache()

    async def load_adapter(self, client: httpx.AsyncClient, base_url: str, name: str, path: str) -> None:
        raise AdapterError(f"cannot load {name!r}: {self.label}'s adapters are fixed at start", 501)

    async def unload_adapter(self, client: httpx.AsyncClient, base_url: str, name: str) -> None:
        raise AdapterError(f"cannot unload {name!r}: {self.label}'s adapters are fixed at start", 501)

    async def runtime_lora_enabled(self, client: httpx.AsyncClient, base_url: str) -> bool:
        return False


def engine_python(spec: EngineSpec, env_var: str) -> str:
    """The interpreter that has the engine installed: option `python`, else `env_var`, else ours.

    Engines usually live in venvs of their own (their pins clash with each other's)."""
    return str(spec.options.get("python") or os.environ.get(env_var) or sys.executable)


def engine_environment(spec: EngineSpec, **fixed: str) -> dict[str, str]:
    """`fixed` variables, the GPUs the engine may use, then the profile's `env` option."""
    env = dict(fixed)
    if spec.gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_ids)
    for key, value in (spec.options.get("env") or {}).items():
        env[str(key)] = str(value)
    return env
