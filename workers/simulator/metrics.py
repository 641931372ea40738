"""Prometheus metrics under vLLM's or LMDeploy's names, each app with its own registry.

The load gauges show the stats the scheduler published at the end of its last step
(`StepStats`), as vLLM's do, never the live queues."""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from workers.simulator.seqs import Seq, StepStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_LABELS = ("model_name", "engine")
# vLLM's own buckets for these two.
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _Tally(Collector):
    """A histogram of one series that takes n observations of a value at once (the
    sequences of one step share their inter-token latency), exposed as a Histogram is."""

    def __init__(self, name: str, doc: str, labels: Mapping[str, str], buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, dict(labels)
        self.bounds = (*buckets, math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        running, buckets = 0, []
        for bound, count in zip(self.bounds, self.counts, strict=True):
            running += count
            buckets.append((floatToGoString(bound), float(running)))
        family.add_metric(list(self.labels.values()), buckets, self.sum)
        yield family


class _Base:
    """Counts shared by both flavours; subclasses name and expose them."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model_name, "engine": "0"}
        self.failed = 0
        # Not a vLLM or LMDeploy metric (neither counts adapter swaps): the simulator's own,
        # so that a benchmark can see LoRA thrashing. Every time an adapter's weights enter
        # a slot (first use or swapped back in after an eviction) counts one.
        self._lora_loads = self._counter(
            "fleetgate_sim:lora_loads", "Adapter weights loaded into a LoRA slot"
        ).labels(**self._labels)
        self._lora_api_loads = self._counter(
            "fleetgate_sim:lora_api_loads", "Adapters added through /v1/load_lora_adapter"
        ).labels(**self._labels)
        # Of the slot loads, those that read the adapter from disk (it was not among the
        # max_cpu_loras adapters held in host memory).
        self._lora_disk_loads = self._counter(
            "fleetgate_sim:lora_disk_loads", "Adapter weights read from disk into host memory"
        ).labels(**self._labels)

    def render(self, stats: StepStats) -> bytes:
        self.refresh(stats)
        return generate_latest(self.registry)

    def refresh(self, stats: StepStats) -> None:
        raise NotImplementedError

    def on_failed(self) -> None:
        self.failed += 1

    def on_lora_loads(self, n: int, from_disk: int = 0) -> None:
        self._lora_loads.inc(n)
        if from_disk:
            self._lora_disk_loads.inc(from_disk)

    def on_lora_api_load(self) -> None:
        self._lora_api_loads.inc()

    def _gauge(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, (*_LABELS, *extra), registry=self.registry)

    def _counter(self, name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, (*_LABELS, *extra), registry=self.registry)

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(name, doc, _LABELS, buckets=_LATENCY_BUCKETS, registry=self.registry)

    def _tally(self, name: str, doc: str, buckets: tuple[float, ...]) -> _Tally:
        tally = _Tally(name, doc, self._labels, buckets)
        self.registry.register(tally)
        return tally


def vllm_cache_config(
    *, num_gpu_blocks: int, block_size: int, max_model_len: int,
    num_gpu_blocks_override: int | None = None, user_specified_block_size: bool = False,
) -> dict[str, str]:  # fmt: skip
    """`vllm:cache_config_info`'s labels as vLLM 0.32 sets them for a full-attention model
    (every CacheConfig field as str, plus `engine`; tests/data's capture has the same set).

    The KV cache holds num_gpu_blocks x block_size tokens (num_gpu_blocks counts vLLM's
    one null block). kv_cache_size_tokens is vLLM's own figure: how many max_model_len
    requests fit, times max_model_len; the same number when max_model_len is a multiple of
    block_size. kv_cache_memory_bytes stays None as on a GPU (only --kv-cache-memory-bytes
    or a CPU's VLLM_CPU_KVCACHE_SPACE set it)."""
    concurrency = num_gpu_blocks / math.ceil(max_model_len / block_size)
    return {
        "_block_size_resolved": "True",
        "block_size": str(block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": "True",
        "engine": "0",
        "gpu_memory_utilization": "0.92",
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(concurrency),
        "kv_cache_memory_bytes": "None",
        "kv_cache_size_tokens": str(int(concurrency * max_model_len)),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(num_gpu_blocks_override),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": str(user_specified_block_size),
    }


class VllmMetrics(_Base):
    def __init__(self, model_name: str, cache_info: dict[str, str], max_loras: int) -> None:
        super().__init__(model_name)
        lab = self._labels
        self._running = self._gauge("vllm:num_requests_running", "Requests in the batch").labels(
            **lab
        )
        self._waiting = self._gauge("vllm:num_requests_waiting", "Requests queued").labels(**lab)
        by_reason = self._gauge(
            "vllm:num_requests_waiting_by_reason", "Requests queued by reason", ("reason",)
        )
        self._waiting_capacity = by_reason.labels(**lab, reason="capacity")
        self._waiting_deferred = by_reason.labels(**lab, reason="deferred")
        self._kv = self._gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1").labels(**lab)
        self._queries = self._counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, tokens"
        ).labels(**lab)
        self._hits = self._counter("vllm:prefix_cache_hits", "Prefix cache hits, tokens").labels(
            **lab
        )
        self._preempt = self._counter("vllm:num_preemptions", "Preemptions").labels(**lab)
        # vLLM 0.32 counts every prompt token here, cached or not, and splits them by source.
        self._prompt = self._counter("vllm:prompt_tokens", "Prompt tokens").labels(**lab)
        by_source = self._counter("vllm:prompt_tokens_by_source", "Prompt tokens", ("source",))
        self._computed = by_source.labels(**lab, source="local_compute")
        self._cache_hit = by_source.labels(**lab, source="local_cache_hit")
        by_source.labels(**lab, source="external_kv_transfer")
        self._gen = self._counter("vllm:generation_tokens", "Tokens generated").labels(**lab)
        self._success = self._counter(
            "vllm:request_success", "Finished requests", ("finished_reason",)
        )
        self._ttft = self._histogram("vllm:time_to_first_token_seconds", "TTFT").labels(**lab)
        self._e2e = self._histogram("vllm:e2e_request_latency_seconds", "End to end").labels(**lab)
        # Per step and per token, as vLLM's: what the agent measures the engine's speed by.
        self._iteration = self._tally("vllm:iteration_tokens_total", "Tokens per engine step",
                                      _ITERATION_BUCKETS)
        self._itl = self._tally("vllm:inter_token_latency_seconds", "Inter-token latency", _ITL_BUCKETS)
        self._queue = self._histogram("vllm:request_queue_time_seconds", "Time waiting").labels(
            **lab
        )
        info = Gauge(
            "vllm:cache_config_info", "Cache config", tuple(cache_info), registry=self.registry
        )
        info.labels(**cache_info).set(1)
        self._max_loras = max_loras
        self._lora: Gauge | None = None
        if max_loras:
            self._lora = Gauge(
                "vllm:lora_requests_info",
                "Running stats on LoRA requests",
                ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                registry=self.registry,
            )

    def refresh(self, stats: StepStats) -> None:
        self._running.set(stats.running)
        self._waiting.set(stats.waiting)
        self._waiting_capacity.set(stats.waiting - stats.deferred)
        self._waiting_deferred.set(stats.deferred)
        self._kv.set(stats.kv_cache_usage)
        if self._lora is not None:
            # Like vLLM: one series per label set ever seen, the value a Unix timestamp; both
            # adapter labels list every adapter with a request in the engine (vLLM 0.32 fills
            # them from one per-adapter table, so they never differ).
            names = ",".join(stats.lora_adapters)
            self._lora.labels(
                max_lora=str(self._max_loras), running_lora_adapters=names, waiting_lora_adapters=names,
            ).set(time.time())

    def on_admitted(self, seq: Seq, now: float) -> None:
        self._queries.inc(seq.num_prompt)  # as at admission: nothing generated yet
        self._hits.inc(seq.cached_tokens)
        self._queue.observe(now - seq.arrival)

    def on_first_token(self, seq: Seq, now: float) -> None:
        self._prompt.inc(seq.num_prompt)
        self._computed.inc(seq.num_prompt - seq.cached_tokens)
        self._cache_hit.inc(seq.cached_tokens)
        self._ttft.observe(now - seq.arrival)

    def on_step(self, scheduled: int, sampled: int, gaps: Mapping[float, int]) -> None:
        if sampled:
            self._gen.inc(sampled)
        self._iteration.observe(scheduled)
        for gap, n in gaps.items():
            self._itl.observe(gap, n)

    def on_finished(self, seq: Seq, reason: str, now: float) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()
        self._e2e.observe(now - seq.arrival)

    def on_preempted(self) -> None:
        self._preempt.inc()


class LmdeployMetrics(_Base):
    """LMDeploy's names; its load gauges refresh only every `refresh_s` (10 s in LMDeploy)."""

    def __init__(self, model_name: str, refresh_s: float) -> None:
        super().__init__(model_name)
        lab = self._labels
        self._refresh_s = refresh_s
        self._last_refresh = float("-inf")
        self._running = self._gauge("lmdeploy:num_requests_running", "Running").labels(**lab)
        self._waiting = self._gauge("lmdeploy:num_requests_waiting", "Waiting").labels(**lab)
        self._kv = self._gauge("lmdeploy:gpu_cache_usage_perc", "KV usage").labels(**lab)
        self._hit_rate = self._gauge("lmdeploy:prefix_cache_hit_rate", "Hit rate").labels(**lab)
        self._ok = self._gauge("lmdeploy:num_requests_succeeded", "Succeeded").labels(**lab)
        self._failed = self._gauge("lmdeploy:num_requests_failed", "Failed").labels(**lab)
        self._routed = self._gauge("lmdeploy:num_api_requests_routed", "Routed").labels(**lab)
        self._api_waiting = self._gauge("lmdeploy:num_api_requests_waiting", "API waiting").labels(
            **lab
        )
        self._prompt = self._counter("lmdeploy:prompt_tokens", "Prompt tokens").labels(**lab)
        self._gen = self._counter("lmdeploy:generation_tokens", "Generated tokens").labels(**lab)
        self._cached = self._counter("lmdeploy:cached_tokens", "Cached tokens").labels(**lab)
        self._ttft = self._histogram("lmdeploy:time_to_first_token_seconds", "TTFT").labels(**lab)
        self._tpot = self._histogram("lmdeploy:time_per_output_token_seconds", "TPOT").labels(**lab)
        self._queue = self._histogram("lmdeploy:request_queue_time_seconds", "Queue").labels(**lab)
        self._e2e = self._histogram("lmdeploy:e2e_request_latency_seconds", "E2E").labels(**lab)
        self._queries = 0
        self._hits = 0
        self._succeeded = 0
        self._admitted = 0

    def refresh(self, stats: StepStats) -> None:
        now = time.monotonic()
        if now - self._last_refresh < self._refresh_s:
            return
        self._last_refresh = now
        self._running.set(stats.running)
        self._waiting.set(stats.waiting)
        self._kv.set(stats.kv_cache_usage)
        self._hit_rate.set(self._hits / self._queries if self._queries else 0.0)
        self._ok.set(self._succeeded)
        self._failed.set(self.failed)
        self._routed.set(self._admitted)
        self._api_waiting.set(stats.waiting)

    def on_admitted(self, seq: Seq, now: float) -> None:
        self._queries += seq.num_prompt
        self._hits += seq.cached_tokens
        self._admitted += 1
        self._cached.inc(seq.cached_tokens)
        self._queue.observe(now - seq.arrival)

    def on_first_token(self, seq: Seq, now: float) -> None:
        self._prompt.inc(seq.num_prompt)
        self._ttft.observe(now - seq.arrival)

    def on_step(self, scheduled: int, sampled: int, gaps: Mapping[float, int]) -> None:
        # LMDeploy counts no steps and times tokens per request (on_finished).
        if sampled:
            self._gen.inc(sampled)

    def on_finished(self, seq: Seq, reason: str, now: float) -> None:
        self._succeeded += 1
        self._e2e.observe(now - seq.arrival)
        if seq.first_token_at is not None and seq.generated > 1:
            self._tpot.observe((now - seq.first_token_at) / (seq.generated - 1))

    def on_preempted(self) -> None:
        pass
