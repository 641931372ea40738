"""The simulator (`python -m workers.simulator`): vLLM's API and metrics without a GPU.

With `options["flavor"] = "lmdeploy"` it speaks LMDeploy's dialect instead; its metrics are
then read under LMDeploy's names (the parser recognises them) and it has no runtime
adapter API, like LMDeploy, and continues a trailing assistant message by itself. Attached
as `--engine external --flavor sim`, the agent knows the flavour only from `--option
flavor=...` (vLLM's without it, as the simulator's own default).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import httpx

from fleetgate.schema import Load
from workers.engines.base import (
    EngineSpec,
    EngineWork,
    KvCache,
    engine_environment,
    flag_args,
    lora_enabled,
)
from workers.engines.lmdeploy import parse_lmdeploy_metrics, parse_lmdeploy_work
from workers.engines.vllm import (
    load_lora,
    parse_vllm_kv_cache,
    parse_vllm_metrics,
    parse_vllm_work,
    runtime_lora_api,
    unload_lora,
)
from workers.speed import sim_profile
from workers.timing import PROFILES

# Options passed through as `--flag value`, in this order.
_FLAGS = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_gpu_blocks",
    "block_size",
    "time_scale",
    "seed",
    "flavor",
    "runner",
    "convert",
)


def _faults(value: Any) -> Iterable[str]:
    """Faults as a list of "key=value" strings or a mapping."""
    if isinstance(value, Mapping):
        return [f"{k}={v}" for k, v in value.items()]
    if isinstance(value, str):
        return [value]
    return [str(item) for item in value or ()]


class SimEngine:
    name: ClassVar[str] = "sim"
    runtime_lora: ClassVar[bool] = True
    reports_load: ClassVar[bool] = True
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str | None] = "/metrics"
    # The `--option` names it reads (anything else is a typo: the agent refuses it).
    options: ClassVar[frozenset[str]] = frozenset(_FLAGS) | {
        "profile", "faults", "max_loras", "max_cpu_loras", "enable_lora", "env"}

    def command(self, spec: EngineSpec) -> list[str]:
        argv = [
            sys.executable, "-m", "workers.simulator",
            "--host", spec.host,
            "--port", str(spec.port),
            "--served-model-name", spec.served_name,
            "--model", spec.model,
            "--max-model-len", str(spec.max_model_len),
            "--profile", sim_profile(spec),
            *flag_args(spec.options, _FLAGS),
        ]  # fmt: skip
        if lora_enabled(spec):
            argv += ["--enable-lora", "--max-loras", str(self.max_loras(spec))]
            if spec.options.get("max_cpu_loras"):
                argv += ["--max-cpu-loras", str(spec.options["max_cpu_loras"])]
            if spec.adapters:
                argv.append("--lora-modules")
                argv.extend(f"{name}={path}" for name, path in spec.adapters.items())
        for fault in _faults(spec.options.get("faults")):
            argv += ["--fault", fault]
        if spec.kv_events_config:
            argv += ["--kv-events-config", spec.kv_events_config]
        argv.extend(spec.extra_args)
        return argv

    def publishes_kv_events(self, spec: EngineSpec) -> bool:
        # As the engine whose dialect it speaks: LMDeploy publishes none.
        return spec.options.get("flavor", "vllm") != "lmdeploy"

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        # As for real engines: the `env` option (e.g. VLLM_ENABLE_RESPONSES_API_STORE: 1).
        return engine_environment(spec)

    def capacity(self, spec: EngineSpec) -> int:
        value = spec.options.get("max_num_seqs")
        return int(value) if value else PROFILES[sim_profile(spec)].max_num_seqs

    def max_loras(self, spec: EngineSpec) -> int:
        if not lora_enabled(spec):
            return 0
        return int(spec.options.get("max_loras") or max(4, len(spec.adapters)))

    def continues_trailing_assistant(self, spec: EngineSpec) -> bool:
        # As the engine whose dialect it speaks (the simulator's default flavour is vLLM's).
        return spec.options.get("flavor", "vllm") == "lmdeploy"

    def parse_metrics(self, text: str) -> Load:
        if "lmdeploy:" in text:
            return parse_lmdeploy_metrics(text)
        return parse_vllm_metrics(text)

    def parse_kv_cache(self, text: str) -> KvCache:
        # In LMDeploy's dialect, as LMDeploy itself: no cache size is published.
        return KvCache() if "lmdeploy:" in text else parse_vllm_kv_cache(text)

    def parse_work(self, text: str) -> EngineWork:
        return parse_lmdeploy_work(text) if "lmdeploy:" in text else parse_vllm_work(text)

    async def load_adapter(
        self, client: httpx.AsyncClient, base_url: str, name: str, path: str
    ) -> None:
        await load_lora(client, base_url, name, path)

    async def unload_adapter(self, client: httpx.AsyncClient, base_url: str, name: str) -> None:
        await unload_lora(client, base_url, name)

    async def runtime_lora_enabled(self, client: httpx.AsyncClient, base_url: str) -> bool:
        return await runtime_lora_api(client, base_url)  # LMDeploy's flavour has none: a plain 404


ENGINE = SimEngine
