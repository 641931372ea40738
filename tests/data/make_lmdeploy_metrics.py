"""Writes lmdeploy-0.18-metrics.txt: LMDeploy's /metrics as documented, not captured.

    .venv/bin/python tests/data/make_lmdeploy_metrics.py

No LMDeploy runs on our CPU machines, so this builds the families LMDeploy's api_server
exposes (names, types, labels `model_name` and `engine`, bucket bounds as its
PrometheusStatLogger declares them) with prometheus_client, which LMDeploy uses too,
and fills them with the values of one plausible busy moment. prometheus_client writes
the exposition text, so the file is in the format a real scrape has.
"""

from __future__ import annotations

from pathlib import Path

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

OUT = Path(__file__).with_name("lmdeploy-0.18-metrics.txt")
LABELS = ["model_name", "engine"]
VALUES = ["tiny", "0"]

# The values the tests expect (tests/unit/test_vllm_engine.py reads the file, not these).
RUNNING, WAITING, KV_USAGE, PREFIX_HIT_RATE = 3, 2, 0.4375, 0.625

LATENCY_BUCKETS = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
TTFT_BUCKETS = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
TPOT_BUCKETS = [
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]


def build() -> bytes:
    prometheus_client.disable_created_metrics()  # as LMDeploy does
    reg = CollectorRegistry()

    def gauge(name: str, doc: str, value: float) -> None:
        Gauge(name, doc, LABELS, registry=reg).labels(*VALUES).set(value)

    def counter(name: str, doc: str, value: float) -> None:
        Counter(name, doc, LABELS, registry=reg).labels(*VALUES).inc(value)

    def histogram(name: str, doc: str, buckets: list[float], observations: list[float]) -> None:
        h = Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*VALUES)
        for x in observations:
            h.observe(x)

    Info("lmdeploy:backend_config", "information of backend_config", registry=reg).info(
        {"backend": "pytorch", "session_len": "4096", "max_batch_size": "256", "tp": "1"}
    )
    gauge("lmdeploy:num_requests_succeeded", "Number of current succeeded requests.", 120)
    gauge("lmdeploy:num_requests_failed", "Number of current failed requests.", 2)
    gauge("lmdeploy:num_api_requests_routed", "Number of requests routed to request handles.", 5)
    gauge(
        "lmdeploy:num_api_requests_waiting",
        "Number of requests waiting for free request handles.",
        0,
    )
    gauge(
        "lmdeploy:num_requests_running", "Number of requests in model execution batches.", RUNNING
    )
    gauge("lmdeploy:num_requests_waiting", "Number of requests waiting to be processed.", WAITING)
    gauge(
        "lmdeploy:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", KV_USAGE
    )
    gauge(
        "lmdeploy:prefix_cache_hit_rate",
        "Prefix-cache hit rate. 1 means 100 percent of queried prefix tokens hit.",
        PREFIX_HIT_RATE,
    )
    counter("lmdeploy:prompt_tokens_total", "Number of prefill tokens processed.", 96000)
    counter("lmdeploy:generation_tokens_total", "Number of generation tokens processed.", 7680)
    counter("lmdeploy:cached_tokens_total", "Total prefix-cached input tokens served.", 60000)
    histogram(
        "lmdeploy:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TTFT_BUCKETS,
        [0.07, 0.09, 0.12, 0.55],
    )
    histogram(
        "lmdeploy:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
        TPOT_BUCKETS,
        [0.021, 0.022, 0.024, 0.03],
    )
    histogram(
        "lmdeploy:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        LATENCY_BUCKETS,
        [1.4, 1.5, 1.7, 2.2],
    )
    histogram(
        "lmdeploy:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        LATENCY_BUCKETS,
        [0.0, 0.0, 0.01, 0.4],
    )
    return prometheus_client.generate_latest(reg)


if __name__ == "__main__":
    OUT.write_bytes(build())
    print(f"wrote {OUT}")
