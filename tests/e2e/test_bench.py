"""The fleet benchmark: seeded workloads, traces, capacity, the report, and a short real run."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from fleetgate_tools.bench.arrivals import bursty_arrivals
from fleetgate_tools.bench.fleet import capacity, load_fleet
from fleetgate_tools.bench.loadgen import Outcome, classify
from fleetgate_tools.bench.png import Canvas, render
from fleetgate_tools.bench.report import format_ratios, format_table, percentile, ratios, summarise
from fleetgate_tools.bench.runner import BenchOptions, plan
from fleetgate_tools.bench.workloads import WORKLOADS, FleetFacts, contents, read_trace, write_trace

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "config/bench/default.yaml"
FACTS = FleetFacts(model="m", adapters=[f"a{i}" for i in range(8)], max_context=32768, min_context=4096)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_are_seeded(name: str) -> None:
    """The same seed gives the same requests; another seed gives others."""
    first = list(itertools.islice(contents(name, 1, FACTS), 40))
    again = list(itertools.islice(contents(name, 1, FACTS), 40))
    other = list(itertools.islice(contents(name, 2, FACTS), 40))
    assert first == again and first != other


def test_prefix_sessions_share_system_prompts_and_grow() -> None:
    """Prefix workload: sessions reuse a few system prompts, later turns extend earlier ones."""
    drafts = list(itertools.islice(contents("prefix", 0, FACTS, {"system_prompts": 4}), 200))
    systems = {d.messages[0]["content"] for d in drafts}
    assert len(systems) <= 4
    by_session: dict[str, list[list[dict[str, str]]]] = {}
    for d in drafts:
        assert d.session is not None
        by_session.setdefault(d.session, []).append(d.messages)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for earlier, later in itertools.pairwise(turns):
            assert later[: len(earlier)] == earlier


def test_adapter_popularity_is_zipf() -> None:
    """Adapters workload: the first adapter is the most requested, the last the least."""
    drafts = list(itertools.islice(contents("adapters", 0, FACTS), 2000))
    counts = [sum(d.model == a for d in drafts) for a in FACTS.adapters]
    assert counts[0] == max(counts) and counts[0] > 3 * counts[-1]


def test_mixed_has_prompts_only_long_workers_fit() -> None:
    """Mixed workload: long prompts exceed the smallest context and fit the largest."""
    from fleetgate_tools.bench.workloads import BenchRequest

    drafts = list(itertools.islice(contents("mixed", 0, FACTS), 300))
    sizes = {
        d.tag: [BenchRequest(id=0, at=0, model="m", messages=d.messages, max_tokens=1).prompt_tokens()
                for x in drafts if x.tag == d.tag]
        for d in drafts
    }  # fmt: skip
    assert set(sizes) == {"short", "medium", "long"}
    assert min(sizes["long"]) > FACTS.min_context and max(sizes["long"]) < FACTS.max_context
    assert max(sizes["medium"]) < FACTS.min_context


@pytest.mark.parametrize(("rate", "duration"), [(5.0, 400.0), (40.0, 50.0)])
def test_bursty_arrivals(rate: float, duration: float) -> None:
    """Arrivals are seeded, ordered, inside the run, and average the target rate."""
    times = bursty_arrivals(rate, duration, seed=3)
    assert times == bursty_arrivals(rate, duration, seed=3) != bursty_arrivals(rate, duration, 4)
    assert times == sorted(times) and 0 <= times[0] and times[-1] < duration
    assert 0.75 < len(times) / (rate * duration) < 1.25


def test_trace_round_trip(tmp_path: Path) -> None:
    """A planned workload written as JSONL reads back identical."""
    spec = load_fleet(DEFAULT)
    reqs = plan(spec, "prefix", BenchOptions(duration_s=3))["requests"]
    write_trace(tmp_path / "t.jsonl", reqs)
    assert read_trace(tmp_path / "t.jsonl") == reqs
    opts = BenchOptions(trace=tmp_path / "t.jsonl")
    assert plan(spec, "trace", opts)["requests"] == reqs


def test_fleet_yaml_and_capacity() -> None:
    """The default fleet: 2 big + 2 small workers, adapter ranges resolved; capacity falls
    with slower time and counts the long-context workers only for long prompts."""
    spec = load_fleet(DEFAULT)
    assert [w.id for w in spec.workers] == ["big-0", "big-1", "small-0", "small-1"]
    assert spec.workers[1].adapters[0] == "lora-04" and len(spec.workers[1].adapters) == 12
    drafts = list(itertools.islice(contents("mixed", 0, spec.facts), 200))
    cap = capacity(spec, drafts)
    slow = spec.__class__(**{**{f: getattr(spec, f) for f in spec.__struct_fields__}, "time_scale": 2.0})
    assert cap > 0 and capacity(slow, drafts) == pytest.approx(cap / 2)
    argv = spec.worker_argv(spec.workers[2], Path("/ad"))
    assert "flavor=lmdeploy" in argv and argv[argv.index("--max-model-len") + 1] == "4096"


@pytest.mark.parametrize(
    ("status", "body", "from_engine", "kind"),
    [
        (429, "", False, "http_429"),
        (400, "This model's maximum context length is 4096 tokens", True, "engine_ctx_400"),
        (400, "Input length (5000) must be smaller than the model context length (4096).", True, "engine_ctx_400"),
        (400, '{"code": "context_length_exceeded"}', False, "gateway_ctx_400"),
        (404, "no such model", False, "http_4xx"),
        (502, "bad gateway", False, "http_5xx"),
    ],
)
def test_error_classes(status: int, body: str, from_engine: bool, kind: str) -> None:
    """Errors are told apart: 429s, engines' context-length 400s, the gateway's own."""
    assert classify(status, body, from_engine) == kind


def test_summary_and_ratios() -> None:
    """Percentiles, throughput, hit rate from engine deltas, shares, and ratios vs round-robin."""
    assert percentile([3, 1, 2, 4], 50) == 2 and percentile([], 99) is None
    outs = [Outcome(id=i, tag="", status=200, worker=f"w{i % 2}", ttft=0.1 * (i + 1), e2e=1.0,
                    out_tokens=10) for i in range(10)]  # fmt: skip
    outs.append(Outcome(id=10, tag="", error="timeout", ttft=5.0))
    deltas = {"w0": {"prefix_hits": 50.0, "prefix_queries": 100.0, "lora_loads": 2.0},
              "w1": {"prefix_hits": 0.0, "prefix_queries": 100.0, "lora_loads": 1.0}}  # fmt: skip
    rr = summarise("prefix", "round_robin", outs, 5.0, deltas)
    assert rr["ok"] == 10 and rr["rps"] == 2.0 and rr["out_tok_s"] == 20.0
    assert rr["ttft_p99"] == 5.0 and rr["error_kinds"] == {"timeout": 1}
    assert rr["prefix_hit_rate"] == 0.25 and rr["lora_loads"] == 3.0
    assert rr["worker_share"] == {"w0": 0.5, "w1": 0.5}
    other = {**rr, "policy": "fleet", "ttft_p99": 1.0, "rps": 3.0}
    rows = ratios([rr, other])
    assert rows[1]["ttft_p99"] == 0.2 and rows[1]["rps"] == 1.5
    assert "fleet" in format_table([rr, other]) and "0.20" in format_ratios(rows)


def test_png_is_valid(tmp_path: Path) -> None:
    """The pure-Python PNG: right signature, size and pixel data."""
    c = Canvas(5, 3)
    c.set(1, 1, (255, 0, 0))
    data = c.png()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[16:24] == (5).to_bytes(4, "big") + (3).to_bytes(4, "big")
    idat = data[data.index(b"IDAT") + 4 : data.index(b"IEND") - 8]
    raw = zlib.decompress(idat)
    assert len(raw) == 3 * (1 + 15) and raw[16 + 1 + 3 : 16 + 1 + 6] == b"\xff\x00\x00"
    run = {"workload": "w", "policy": "p", "ttft_sorted": [0.1, 0.2], "out_tok_s": 3.0}
    render([run], tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


def test_smoke_run(tmp_path: Path) -> None:
    """A few seconds of the prefix workload through a tiny real fleet under two policies:
    the JSON report has every figure for each, and an unknown policy is skipped."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "model: tiny\ntime_scale: 1.0\nworkers:\n"
        "  - {id: w, count: 2, profile: h100-7b, max_model_len: 8192, options: {num_gpu_blocks: 512}}\n"
        "workloads:\n  prefix: {system_prompts: 4, system_tokens: 300, max_tokens: 8}\n"
    )
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench_fleet.py"), "--fleet", str(fleet),
         "--workloads", "prefix", "--policies", "round_robin,least_outstanding,no_such_policy",
         "--rate", "6", "--duration", "2", "--drain", "5", "--out", str(out),
         "--run-dir", str(tmp_path / "run"), "--dump-trace", str(tmp_path / "trace.jsonl")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no_such_policy" in proc.stderr and "round_robin" in proc.stdout
    result = json.loads(out.read_text())
    runs = {r["policy"]: r for r in result["runs"]}
    assert set(runs) == {"round_robin", "least_outstanding"}
    for r in runs.values():
        assert r["requests"] == len(read_trace(tmp_path / "trace.jsonl")) > 0
        assert r["ok"] > 0 and r["ttft_p50"] is not None and r["out_tok_s"] > 0
        assert set(r["worker_share"]) <= {"w-0", "w-1"} and r["prefix_query_tokens"] > 0
        for key in ("ttft_p90", "ttft_p99", "e2e_p50", "e2e_p99", "http_429", "engine_ctx_400",
                    "prefix_hit_rate", "lora_loads", "preemptions", "errors"):  # fmt: skip
            assert key in r
    assert result["skipped_policies"] == ["no_such_policy"]
    assert [row["policy"] for row in result["ratios"]] == ["round_robin", "least_outstanding"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_attach_mode_measures_a_running_gateway(fleet_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """--attach: the benchmark measures a gateway it did not start and writes its report."""
    import json
    import subprocess
    import sys

    from tests.conftest import ADMIN_TOKEN, ROOT

    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("w", "--model", "bench-7b", "--max-model-len", "32768", "--option", "time_scale=0.02")
    fleet.wait_ready(url, "w")
    out = tmp_path / "attached.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_fleet.py", "--attach", url, "--admin-token", ADMIN_TOKEN,
         "--workloads", "prefix", "--rate", "5", "--duration", "2", "--drain", "5", "--out", str(out),
         "--png", str(tmp_path / "attached.png")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["runs"] and report["runs"][0]["requests"] > 0


def test_multiturn_smoke_run(tmp_path: Path) -> None:
    """A few seconds of multi-turn conversations through a tiny real fleet, a client-side
    strategy beside a gateway policy with routing options: every run has the conversation
    figures, the engines' hit rate and gauges, the option the gateway does not know is
    reported, and the GPU tables read the runs."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        "model: chat\ntime_scale: 1.0\nworkers:\n"
        "  - {id: w, count: 2, profile: h100-7b, max_model_len: 8192, options: {num_gpu_blocks: 512}}\n"
        "workloads:\n  multiturn: {system_prompts: 2, system_tokens: 200, context_tokens: 300, turns_min: 2,\n"
        "              turns_max: 3, user_tokens: 30, max_tokens: 8, think_s: 0.3, think_min_s: 0.1}\n"
    )
    out = tmp_path / "r.json"
    variant = "fleet+balance=0.3+no_such_knob=1"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts/bench_fleet.py"), "--fleet", str(fleet), "--workloads", "multiturn",
         "--policies", f"direct_round_robin,{variant}", "--rate", "2", "--duration", "2", "--drain", "5",
         "--out", str(out), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "turns ok/sent/plan" in proc.stdout and "conversations at 2.0 conversations/s" in proc.stdout
    result = json.loads(out.read_text())
    runs = {r["policy"]: r for r in result["runs"]}
    assert set(runs) == {"direct_round_robin", variant}
    assert runs[variant]["routing_ignored"] == ["no_such_knob"] and "routing_ignored" not in runs["direct_round_robin"]
    for r in runs.values():
        assert r["turns_planned"] == result["plans"]["multiturn"]["turns"] >= r["turns_sent"] == r["requests"] > 0
        assert r["ok"] > 0 and r["conversations"] == result["plans"]["multiturn"]["requests"]
        for key in ("ttft_p50", "ttft_p99", "ttft_p50_later", "ttft_p99_later", "out_tok_s", "http_429", "moved",
                    "prefix_hit_rate", "preemptions", "eng_waiting_max", "eng_running_mean", "eng_kv_mean"):
            assert key in r, key
        assert r["prefix_query_tokens"] > 0 and r["eng_samples"] > 0 and r["kv_events_workers"] in ("0/2", "1/2", "2/2")
        assert r["live_tokens_max"] > 0 and r["fleet_kv_tokens"] == 2 * 512 * 16
    results = tmp_path / "res"
    results.mkdir()
    for r in result["runs"]:
        (results / f"mt2-{r['policy']}-r1.json").write_text(json.dumps({"runs": [r], "meta": {"rate": 2.0}}))
    tables = subprocess.run([sys.executable, "-m", "fleetgate_tools.bench.multiturn_tables", str(results),
                             str(tmp_path / "md")], capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert tables.returncode == 0, tables.stderr
    assert "## Done when (issue 31, multi-turn)" in (tmp_path / "md/results-multiturn.md").read_text()
