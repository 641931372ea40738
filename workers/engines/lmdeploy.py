"""LMDeploy's OpenAI server (`lmdeploy serve api_server`).

Adapters are fixed at start (`--adapters name=path`, PyTorch backend only); there is no
runtime load API. Its load gauges (running, waiting, KV usage) refresh only every 10 s,
hard-coded in LMDeploy: they lag, so the gateway's own in-flight count must weigh more
for this engine than the scrape does. Metrics are on by default from 0.11
(`--disable-metrics` turns them off); before 0.11 they need `--enable-metrics`, which
the `enable_metrics` option passes. The names are the same either way.
"""

from __future__ import annotations

from typing import ClassVar

from fleetgate.schema import Load
from workers.engines.base import (
    EngineSpec,
    EngineWork,
    FixedAtStart,
    engine_environment,
    engine_python,
    flag_args,
    histogram,
    metric_samples,
    peak,
    start_adapter_args,
    total,
)

# Flags taken from the profile / command line, in the order they are emitted.
_FLAGS = (
    "tp",
    "max_batch_size",
    "cache_max_entry_count",
    "quant_policy",
    "cache_block_seq_len",
    "max_prefill_token_num",
    "enable_prefix_caching",
    "eager_mode",
    "dtype",
    "device",
    "enable_metrics",
    "log_level",
)

# LMDeploy's own default batch size depends on the card (128 to 512), so the argv always
# names it: capacity() must be true.
DEFAULT_MAX_BATCH_SIZE = 128


def parse_lmdeploy_metrics(text: str) -> Load:
    """LMDeploy's gauges; it has no prefix-cache query counter, so prompt tokens stand for queries."""
    s = metric_samples(text)
    return Load(
        running=int(total(s, "lmdeploy:num_requests_running")),
        waiting=int(total(s, "lmdeploy:num_requests_waiting")),
        kv_cache_usage=peak(s, "lmdeploy:gpu_cache_usage_perc"),
        kv_measured="lmdeploy:gpu_cache_usage_perc" in s,
        prefix_cache_queries=total(s, "lmdeploy:prompt_tokens_total"),
        prefix_cache_hits=total(s, "lmdeploy:cached_tokens_total"),
    )


def parse_lmdeploy_work(text: str) -> EngineWork:
    """LMDeploy's work counters: tokens generated, prompt tokens less cached ones, and its
    time per output token, observed once per finished request (its mean). It counts no
    engine steps. Its counters, unlike its gauges, are live."""
    s = metric_samples(text)
    latency_sum, latency_count = histogram(s, "lmdeploy:time_per_output_token_seconds")
    prefilled = total(s, "lmdeploy:prompt_tokens_total") - total(s, "lmdeploy:cached_tokens_total")
    return EngineWork(
        generated=total(s, "lmdeploy:generation_tokens_total"),
        prefilled=max(0.0, prefilled),
        latency_sum=latency_sum,
        latency_count=latency_count,
    )


def backend(spec: EngineSpec) -> str:
    """The option's backend; else PyTorch when adapters are given (TurboMind serves none), else TurboMind."""
    chosen = spec.options.get("backend")
    if chosen:
        return str(chosen)
    return "pytorch" if spec.adapters else "turbomind"


class LmdeployEngine(FixedAtStart):
    name: ClassVar[str] = "lmdeploy"
    label: ClassVar[str] = "LMDeploy"
    # True, but the gauges are up to 10 s old (see the module docstring).
    reports_load: ClassVar[bool] = True
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str | None] = "/metrics"
    # The `--option` names it reads (anything else is a typo: the agent refuses it).
    options: ClassVar[frozenset[str]] = frozenset(_FLAGS) | {"python", "env", "enable_lora", "backend"}

    def command(self, spec: EngineSpec) -> list[str]:
        python = engine_python(spec, "FLEETGATE_LMDEPLOY_PYTHON")
        chosen = backend(spec)
        if spec.adapters and chosen != "pytorch":
            raise ValueError(
                f"LMDeploy serves LoRA adapters only with its PyTorch backend, not {chosen}: "
                "pass --option backend=pytorch (or drop --adapters)"
            )
        options = dict(spec.options)
        options["max_batch_size"] = self.capacity(spec)
        if len(spec.gpu_ids) > 1:
            options.setdefault("tp", len(spec.gpu_ids))
        return [
            str(python), "-m", "lmdeploy", "serve", "api_server", spec.model,
            "--server-name", spec.host,
            "--server-port", str(spec.port),
            "--model-name", spec.served_name,
            "--backend", chosen,
            "--session-len", str(spec.max_model_len),
            *flag_args(options, _FLAGS),
            *start_adapter_args(spec),
            *spec.extra_args,
        ]  # fmt: skip

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        return engine_environment(spec)

    def capacity(self, spec: EngineSpec) -> int:
        return int(spec.options.get("max_batch_size") or DEFAULT_MAX_BATCH_SIZE)

    def continues_trailing_assistant(self, spec: EngineSpec) -> bool:
        return True  # its chat template leaves a trailing assistant message open

    def parse_metrics(self, text: str) -> Load:
        return parse_lmdeploy_metrics(text)

    def parse_work(self, text: str) -> EngineWork:
        return parse_lmdeploy_work(text)


ENGINE = LmdeployEngine
