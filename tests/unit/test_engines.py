"""LmdeployEngine and SwiftEngine without an engine process: their argv, environment and metrics.

The argv tables are checked against the engines' real CLIs: LMDeploy's
`lmdeploy serve api_server --help` (0.10+) and ms-swift 4.6.0's `swift deploy --help`,
read in the .venv-swift that `make swift` builds.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from fleetgate.schema import Load
from workers.engines import AdapterError, EngineSpec, get_engine, known_engines
from workers.engines.base import KvCache
from workers.engines.lmdeploy import LmdeployEngine, parse_lmdeploy_metrics
from workers.engines.sim import SimEngine
from workers.engines.swift import LAUNCH, SwiftEngine

PY = "/venvs/engine/bin/python"

# An excerpt of LMDeploy's /metrics in its exposition format (prometheus_client, labels
# model_name and engine). Built from LMDeploy's documented names, not captured: no
# LMDeploy runs on the CPU machines (tests/data/README.md). Running 3, waiting 2.
LMDEPLOY_METRICS = """\
# HELP lmdeploy:num_requests_running Number of requests in model execution batches.
# TYPE lmdeploy:num_requests_running gauge
lmdeploy:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP lmdeploy:num_requests_waiting Number of requests waiting to be processed.
# TYPE lmdeploy:num_requests_waiting gauge
lmdeploy:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP lmdeploy:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE lmdeploy:gpu_cache_usage_perc gauge
lmdeploy:gpu_cache_usage_perc{engine="0",model_name="tiny"} 0.4375
# HELP lmdeploy:prefix_cache_hit_rate Prefix-cache hit rate.
# TYPE lmdeploy:prefix_cache_hit_rate gauge
lmdeploy:prefix_cache_hit_rate{engine="0",model_name="tiny"} 0.625
# HELP lmdeploy:prompt_tokens_total Number of prefill tokens processed.
# TYPE lmdeploy:prompt_tokens_total counter
lmdeploy:prompt_tokens_total{engine="0",model_name="tiny"} 96000.0
# HELP lmdeploy:cached_tokens_total Total prefix-cached input tokens served.
# TYPE lmdeploy:cached_tokens_total counter
lmdeploy:cached_tokens_total{engine="0",model_name="tiny"} 60000.0
# HELP lmdeploy:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE lmdeploy:time_to_first_token_seconds histogram
lmdeploy:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="tiny"} 2.0
lmdeploy:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 5.0
lmdeploy:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 5.0
lmdeploy:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 1.5
"""

BUSY = Load(running=3, waiting=2, kv_cache_usage=0.4375, kv_measured=True, prefix_cache_queries=96000.0, prefix_cache_hits=60000.0)


def _data_parallel(text: str) -> str:
    """The same scrape with a second engine rank (`--dp 2`) carrying other figures."""
    extra = {
        "num_requests_running": 4.0, "num_requests_waiting": 1.0, "gpu_cache_usage_perc": 0.75,
        "prompt_tokens_total": 4000.0, "cached_tokens_total": 1000.0,
    }
    for name, value in extra.items():
        line = next(ln for ln in text.splitlines() if ln.startswith(f"lmdeploy:{name}{{"))
        text = text.replace(line, f'{line}\nlmdeploy:{name}{{engine="1",model_name="tiny"}} {value}')
    return text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(LMDEPLOY_METRICS, BUSY, id="busy"),
        pytest.param(
            _data_parallel(LMDEPLOY_METRICS),
            Load(running=7, waiting=3, kv_cache_usage=0.75, kv_measured=True, prefix_cache_queries=100000.0,
                 prefix_cache_hits=61000.0),
            id="two-ranks-sum-counts-max-kv",
        ),
        pytest.param("", Load(), id="empty"),
        pytest.param('vllm:num_requests_running{engine="0",model_name="m"} 9.0\n', Load(), id="vllm-names-ignored"),
    ],
)
def test_parse_lmdeploy_metrics(text: str, expected: Load) -> None:
    """LMDeploy's load record: its own names only, ranks summed, KV usage the fullest rank's."""
    assert parse_lmdeploy_metrics(text) == expected
    assert LmdeployEngine().parse_metrics(text) == expected


def test_simulator_in_lmdeploy_flavour_uses_the_same_parser() -> None:
    """The simulator's LMDeploy dialect is read by LmdeployEngine's parser, not a copy of it."""
    assert SimEngine().parse_metrics(LMDEPLOY_METRICS) == BUSY


def test_lmdeploy_publishes_no_kv_cache_size() -> None:
    """LMDeploy's metrics give the cache's usage, never its size: the registered size is 0 (unknown)."""
    assert LmdeployEngine().parse_kv_cache(LMDEPLOY_METRICS) == KvCache()
    assert SimEngine().parse_kv_cache(LMDEPLOY_METRICS) == KvCache()
    assert SwiftEngine().parse_kv_cache("") == KvCache()


def _spec(**kw: Any) -> EngineSpec:
    base: dict[str, Any] = {"model": "/models/m", "served_name": "m", "port": 8100, "max_model_len": 4096}
    return EngineSpec(**{**base, **kw})


LMDEPLOY_HEAD = [PY, "-m", "lmdeploy", "serve", "api_server", "/models/m", "--server-name", "127.0.0.1",
                 "--server-port", "8100", "--model-name", "m"]


@pytest.mark.parametrize(
    ("spec", "tail"),
    [
        pytest.param(
            _spec(options={"python": PY}),
            ["--backend", "turbomind", "--session-len", "4096", "--max-batch-size", "128"],
            id="defaults",
        ),
        pytest.param(
            _spec(max_model_len=2048, options={"python": PY, "quant_policy": 4, "cache_max_entry_count": 0.8,
                                               "max_batch_size": 16, "enable_prefix_caching": True}),
            ["--backend", "turbomind", "--session-len", "2048", "--max-batch-size", "16",
             "--cache-max-entry-count", "0.8", "--quant-policy", "4", "--enable-prefix-caching"],
            id="t4-profile",
        ),
        pytest.param(
            _spec(adapters={"a": "/lora/a", "b": "/lora/b"}, options={"python": PY}),
            ["--backend", "pytorch", "--session-len", "4096", "--max-batch-size", "128",
             "--adapters", "a=/lora/a", "b=/lora/b"],
            id="adapters-pick-pytorch",
        ),
        pytest.param(
            _spec(gpu_ids=("0", "1"), options={"python": PY, "backend": "pytorch", "eager_mode": True}),
            ["--backend", "pytorch", "--session-len", "4096", "--tp", "2", "--max-batch-size", "128",
             "--eager-mode"],
            id="two-gpus-tensor-parallel",
        ),
        pytest.param(
            _spec(gpu_ids=("0", "1"), options={"python": PY, "tp": 1, "quant_policy": 0}),
            ["--backend", "turbomind", "--session-len", "4096", "--tp", "1", "--max-batch-size", "128",
             "--quant-policy", "0"],
            id="tp-option-wins",
        ),
        pytest.param(
            _spec(options={"python": PY, "enable_metrics": True}, extra_args=("--log-level", "ERROR")),
            ["--backend", "turbomind", "--session-len", "4096", "--max-batch-size", "128",
             "--enable-metrics", "--log-level", "ERROR"],
            id="pre-0.11-metrics-flag-and-extra-args",
        ),
    ],
)
def test_lmdeploy_command(spec: EngineSpec, tail: list[str]) -> None:
    """`lmdeploy serve api_server` argv: profile options become its flags, in a stable order."""
    assert LmdeployEngine().command(spec) == LMDEPLOY_HEAD + tail


def test_lmdeploy_refuses_adapters_on_turbomind() -> None:
    """TurboMind serves no LoRA: asking for both fails when the command is built, not at start."""
    spec = _spec(adapters={"a": "/lora/a"}, options={"backend": "turbomind"})
    with pytest.raises(ValueError, match="pytorch"):
        LmdeployEngine().command(spec)


def test_lmdeploy_python_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLEETGATE_LMDEPLOY_PYTHON picks the interpreter when no `python` option is given."""
    monkeypatch.setenv("FLEETGATE_LMDEPLOY_PYTHON", "/opt/lmdeploy/bin/python")
    assert LmdeployEngine().command(_spec())[0] == "/opt/lmdeploy/bin/python"


@pytest.mark.parametrize("engine", [LmdeployEngine(), SwiftEngine()], ids=["lmdeploy", "swift"])
def test_environment_pins_the_cards_and_adds_option_env(engine: Any) -> None:
    """CUDA_VISIBLE_DEVICES follows the GPU ids; the `env` option adds variables."""
    env = engine.environment(_spec(gpu_ids=("2", "3"), options={"env": {"NCCL_DEBUG": "WARN"}}))
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["NCCL_DEBUG"] == "WARN"
    assert "CUDA_VISIBLE_DEVICES" not in engine.environment(_spec())


SWIFT_HEAD = [PY, "-c", LAUNCH, "--model", "/models/m", "--model_type", "qwen2", "--template", "qwen"]


@pytest.mark.parametrize(
    ("spec", "tail"),
    [
        pytest.param(
            _spec(options={"python": PY}),
            ["--infer_backend", "transformers", "--host", "127.0.0.1", "--port", "8100",
             "--served_model_name", "m", "--max_length", "4096", "--verbose", "false", "--log_interval", "-1"],
            id="defaults",
        ),
        pytest.param(
            _spec(adapters={"lo": "/lora/lo"}, options={"python": PY, "api_key": "k", "verbose": True}),
            ["--infer_backend", "transformers", "--host", "127.0.0.1", "--port", "8100",
             "--served_model_name", "m", "--max_length", "4096", "--api_key", "k", "--verbose", "true",
             "--log_interval", "-1", "--adapters", "lo=/lora/lo"],
            id="adapter-and-api-key",
        ),
        pytest.param(
            _spec(gpu_ids=("0", "1"), options={"python": PY, "infer_backend": "vllm", "max_batch_size": 64,
                                               "vllm_gpu_memory_utilization": 0.9}),
            ["--infer_backend", "vllm", "--host", "127.0.0.1", "--port", "8100",
             "--served_model_name", "m", "--max_length", "4096", "--max_batch_size", "64",
             "--verbose", "false", "--log_interval", "-1", "--vllm_tensor_parallel_size", "2",
             "--vllm_gpu_memory_utilization", "0.9", "--vllm_max_model_len", "4096"],
            id="vllm-backend-two-gpus",
        ),
        pytest.param(
            _spec(options={"python": PY, "infer_backend": "lmdeploy", "lmdeploy_quant_policy": 8}),
            ["--infer_backend", "lmdeploy", "--host", "127.0.0.1", "--port", "8100",
             "--served_model_name", "m", "--max_length", "4096", "--verbose", "false",
             "--log_interval", "-1", "--lmdeploy_session_len", "4096", "--lmdeploy_quant_policy", "8"],
            id="lmdeploy-backend",
        ),
        pytest.param(
            _spec(options={"python": PY, "model_type": "llama3", "template": "llama3"}),
            None,
            id="model-type-and-template",
        ),
    ],
)
def test_swift_command(spec: EngineSpec, tail: list[str] | None) -> None:
    """`swift deploy` argv: swift's underscore flags, explicit booleans, backend-specific limits."""
    argv = SwiftEngine().command(spec)
    if tail is None:
        assert argv[5:9] == ["--model_type", "llama3", "--template", "llama3"]
    else:
        assert argv == SWIFT_HEAD + tail


@pytest.mark.parametrize(
    ("options", "adapters", "match"),
    [
        ({"infer_backend": "sglang"}, {}, "infer_backend"),
        ({"max_batch_size": 4}, {"lo": "/lora/lo"}, "max_batch_size 1"),
    ],
    ids=["unsupported-backend", "batched-adapters-on-transformers"],
)
def test_swift_refuses_what_it_cannot_serve(options: dict[str, Any], adapters: dict[str, str], match: str) -> None:
    """Combinations swift fails on at request time are refused when the command is built."""
    with pytest.raises(ValueError, match=match):
        SwiftEngine().command(_spec(options=options, adapters=adapters))


@pytest.mark.parametrize(
    ("engine", "spec", "capacity", "max_loras"),
    [
        (LmdeployEngine(), _spec(), 128, 0),
        (LmdeployEngine(), _spec(options={"max_batch_size": 16}, adapters={"a": "/a", "b": "/b"}), 16, 2),
        (SwiftEngine(), _spec(), 1, 0),
        (SwiftEngine(), _spec(options={"max_batch_size": 8}), 8, 0),
        (SwiftEngine(), _spec(adapters={"lo": "/lo"}), 1, 1),
    ],
    ids=["lmdeploy-default", "lmdeploy-profile", "swift-serial", "swift-batched", "swift-adapter"],
)
def test_capacity_and_adapter_slots(engine: Any, spec: EngineSpec, capacity: int, max_loras: int) -> None:
    """Capacity is the batch size the argv names; start-time adapters are the only slots."""
    assert engine.capacity(spec) == capacity
    assert engine.max_loras(spec) == max_loras


@pytest.mark.parametrize("name", ["lmdeploy", "swift"])
def test_start_time_adapters_refuse_runtime_changes(name: str) -> None:
    """Neither engine can load or unload an adapter while running: a 501, no HTTP call."""
    engine = get_engine(name)
    assert engine.runtime_lora is False and engine.health_path == "/health"

    async def attempt() -> list[int]:
        statuses = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(500))) as client:
            for call in (engine.load_adapter(client, "http://e", "a", "/a"), engine.unload_adapter(client, "http://e", "a")):
                with pytest.raises(AdapterError) as info:
                    await call
                statuses.append(info.value.status)
        return statuses

    assert asyncio.run(attempt()) == [501, 501]


@pytest.mark.parametrize(("name", "options", "continues"), [
    ("vllm", {}, False),
    ("lmdeploy", {}, True),
    ("swift", {}, True),
    ("swift", {"infer_backend": "vllm"}, True),  # swift's own template, whatever runs under it
    ("sim", {}, False),  # the simulator's default flavour is vLLM's
    ("sim", {"flavor": "vllm"}, False),
    ("sim", {"flavor": "lmdeploy"}, True),
])
def test_each_engine_declares_whether_it_continues_a_trailing_assistant_message(
    name: str, options: dict[str, Any], continues: bool,
) -> None:
    """Every engine file answers for itself (the gateway resumes cut streams by it); the simulator
    answers as the engine whose flavour it speaks."""
    spec = EngineSpec(model="m", served_name="m", port=1, options=options)
    assert get_engine(name).continues_trailing_assistant(spec) is continues


def test_engine_capabilities() -> None:
    """LMDeploy reports load through /metrics; swift has none, so the gateway's count is its load."""
    assert {"lmdeploy", "swift"} <= set(known_engines())
    lmdeploy, swift = get_engine("lmdeploy"), get_engine("swift")
    assert (lmdeploy.reports_load, lmdeploy.metrics_path) == (True, "/metrics")
    assert (swift.reports_load, swift.metrics_path) == (False, None)
    assert swift.parse_metrics("anything") == Load()
