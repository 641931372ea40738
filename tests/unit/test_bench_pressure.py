"""Issue 14's benchmark pieces: the tenant workloads, client-side strategies, the herding and
off-majority figures, 429s by code, the capacity search, and the oracle over a real fleet."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetgate_tools.bench import engines
from fleetgate_tools.bench.arrivals import arrivals, bursty_arrivals, poisson_arrivals
from fleetgate_tools.bench.cluster import running
from fleetgate_tools.bench.engines import WorkerRef
from fleetgate_tools.bench.fleet import FleetSpec, WorkerSpec, load_fleet
from fleetgate_tools.bench.herding import Routed, herding, off_majority
from fleetgate_tools.bench.loadgen import Outcome, error_code, run_requests
from fleetgate_tools.bench.report import format_routing, ratios, summarise
from fleetgate_tools.bench.runner import (
    BenchOptions,
    attached_policies,
    known_policies,
    plan,
    rotated,
)
from fleetgate_tools.bench.search import find_capacity, passes
from fleetgate_tools.bench.strategies import direct_round_robin, tenant_affinity, tenant_of
from fleetgate_tools.bench.workloads import BenchRequest, Draft, FleetFacts, contents

ROOT = Path(__file__).resolve().parents[2]
FACTS = FleetFacts(model="m")


def _req(d: Draft, i: int = 0) -> BenchRequest:
    return BenchRequest(id=i, at=0.0, model=d.model, messages=d.messages, max_tokens=d.max_tokens, tag=d.tag)


def test_pressure_workload_shape() -> None:
    """pressure: 16 tenants with their own ~1,500-token system prompt, a unique ~65-token
    question per request, 64 output tokens streamed with ignore_eos, tagged by tenant."""
    drafts = list(itertools.islice(contents("pressure", 0, FACTS), 800))
    systems: dict[str, set[str]] = {}
    for d in drafts:
        assert [m["role"] for m in d.messages] == ["system", "user"] and d.max_tokens == 64
        systems.setdefault(d.tag, set()).add(d.messages[0]["content"])
    assert sorted(systems, key=lambda t: tenant_of(t) or 0) == [f"tenant-{i}" for i in range(16)]
    assert all(len(s) == 1 for s in systems.values())
    for tag, (text,) in systems.items():
        assert text.startswith(f"[tenant {tenant_of(tag)}] ")
        assert 1490 <= len(text.encode()) / 4 <= 1520
    questions = [d.messages[1]["content"] for d in drafts]
    assert len(set(questions)) == len(questions)
    assert all(60 <= len(q.encode()) / 4 <= 72 for q in questions)
    body = _req(drafts[0]).body()
    assert body["ignore_eos"] is True and body["stream"] is True and "user" not in body
    counts = Counter(d.tag for d in drafts)
    assert max(counts.values()) < 3 * min(counts.values())


def test_skew_has_one_hot_tenant() -> None:
    """skew: tenant 0 gets ~40% of the requests, the other 15 share the rest evenly."""
    drafts = list(itertools.islice(contents("skew", 0, FACTS), 5000))
    counts = Counter(d.tag for d in drafts)
    assert 0.37 < counts["tenant-0"] / 5000 < 0.43
    assert all(0.025 < counts[f"tenant-{i}"] / 5000 < 0.055 for i in range(1, 16))


def test_tenant_workload_params() -> None:
    """Tenant count, prompt sizes and the hot share come from the fleet file's params."""
    drafts = list(itertools.islice(contents("skew", 1, FACTS, {"tenants": 3, "system_tokens": 50,
                                                                "max_tokens": 8, "hot_share": 0.8}), 500))  # fmt: skip
    counts = Counter(d.tag for d in drafts)
    assert set(counts) == {"tenant-0", "tenant-1", "tenant-2"} and counts["tenant-0"] > 350
    assert all(d.max_tokens == 8 and len(d.messages[0]["content"]) < 260 for d in drafts)
    with pytest.raises(ValueError, match="hot_share"):
        next(contents("skew", 0, FACTS, {"hot_share": 1.0}))


def test_poisson_arrivals_and_which_workloads_get_them() -> None:
    """Tenant workloads arrive as plain Poisson (seeded, ordered, at the rate), the others
    bursty unless their params say otherwise."""
    times = poisson_arrivals(20.0, 200.0, seed=5)
    assert times == poisson_arrivals(20.0, 200.0, seed=5) != poisson_arrivals(20.0, 200.0, seed=6)
    assert times == sorted(times) and 0 < times[0] and times[-1] < 200.0
    assert 0.95 < len(times) / 4000 < 1.05
    assert arrivals("pressure", 20.0, 200.0, 5) == times
    assert arrivals("skew", 20.0, 200.0, 5) == times
    assert arrivals("prefix", 20.0, 200.0, 5) == bursty_arrivals(20.0, 200.0, 5)
    assert arrivals("prefix", 20.0, 200.0, 5, {"arrivals": "poisson"}) == times
    with pytest.raises(ValueError, match="arrival"):
        arrivals("prefix", 1.0, 1.0, 0, {"arrivals": "uniform"})


def test_pressure_fleets() -> None:
    """config/bench/pressure.yaml and ample.yaml: two h200-7b sim workers, 1024 seqs, time
    scale 4; 2106 blocks of 16 (the GPU run's 33.7k tokens) and 8x that; the same plan."""
    pressure, ample = load_fleet(ROOT / "config/bench/pressure.yaml"), load_fleet(ROOT / "config/bench/ample.yaml")
    for spec, blocks in ((pressure, 2106), (ample, 8 * 2106)):
        assert [w.id for w in spec.workers] == ["w0", "w1"] and spec.time_scale == 4.0
        for w in spec.workers:
            assert w.profile == "h200-7b" and w.option("max_num_seqs") == 1024
            assert w.option("num_gpu_blocks") == blocks and w.option("block_size") == 16
    opts = BenchOptions(rate=30.0, duration_s=4.0)
    a, b = plan(pressure, "pressure", opts), plan(ample, "pressure", opts)
    assert a["requests"] == b["requests"] and 80 < len(a["requests"]) < 160
    assert 1570 < a["prompt_tokens_estimate"] < 1610
    # The tenants' prompts fit two workers' caches, not one's.
    prompts = {r.tag: r.messages[0]["content"] for r in a["requests"]}
    total = sum(len(p.encode()) / 4 for p in prompts.values())
    assert 2106 * 16 * 0.6 < total < 2106 * 16


@pytest.mark.parametrize(
    ("routed", "expected"),
    [
        # 10 arrivals in second 0 all to a, 10 in second 1 split 5/5: one herded window of two.
        ([Routed(0.05 * i, "a") for i in range(10)]
         + [Routed(1 + 0.05 * i, "ab"[i % 2]) for i in range(10)], (1, 2)),
        # 9 of 10 to one worker is >= 90%: herded; 8 of 10 is not.
        ([Routed(0.1 * i, "a" if i else "b") for i in range(10)], (1, 1)),
        ([Routed(0.1 * i, "a" if i > 1 else "b") for i in range(10)], (0, 1)),
        # Fewer than 8 routed arrivals: the window does not count.
        ([Routed(0.1 * i, "a") for i in range(7)], (0, 0)),
        # Refused requests (no worker) are not arrivals at a worker.
        ([Routed(0.1 * i, "a") for i in range(7)] + [Routed(0.75, None)] * 5, (0, 0)),
        # Windows are whole seconds of arrival time: 0.95 and 1.05 fall in different ones.
        ([Routed(0.95, "a")] * 8 + [Routed(1.05, "b")] * 8, (2, 2)),
        ([], (0, 0)),
    ],
)  # fmt: skip
def test_herding(routed: list[Routed], expected: tuple[int, int]) -> None:
    """Herded windows: >= 90% of a second's (>= 8) routed arrivals on one worker."""
    assert tuple(herding(routed)) == expected


@pytest.mark.parametrize(
    ("routed", "expected"),
    [
        ([Routed(0, "a", "tenant-0")] * 3 + [Routed(0, "b", "tenant-1")] * 3, 0.0),
        # tenant-0: 3 on a, 1 on b; tenant-1: 2 on b, 2 on a -> (1 + 2) of 8.
        ([Routed(0, "a", "tenant-0")] * 3 + [Routed(0, "b", "tenant-0")]
         + [Routed(0, "b", "tenant-1")] * 2 + [Routed(0, "a", "tenant-1")] * 2, 3 / 8),
        # Refused requests and untagged ones are left out.
        ([Routed(0, "a", "tenant-0")] * 2 + [Routed(0, None, "tenant-0")] * 5
         + [Routed(0, "b", "turn-1")] * 5, 0.0),
        ([Routed(0, "a", "turn-1")], None),
    ],
)  # fmt: skip
def test_off_majority(routed: list[Routed], expected: float | None) -> None:
    """Off-majority: the share of a tenant's routed requests away from its busiest worker."""
    assert off_majority(routed) == expected


def test_tenant_affinity_and_direct_round_robin_routes() -> None:
    """tenant i -> the i % N-th ready worker by id; untagged requests stick by their first
    message; direct round-robin cycles the ready workers in id order."""
    workers = [WorkerRef("w2", "http://c"), WorkerRef("w0", "http://a"), WorkerRef("w1", "http://b"),
               WorkerRef("w9", "http://z", state="draining")]  # fmt: skip
    route = tenant_affinity(workers)
    reqs = [BenchRequest(id=i, at=0, model="m", messages=[{"role": "system", "content": f"s{i % 5}"}],
                         max_tokens=1, tag=f"tenant-{i}") for i in range(7)]  # fmt: skip
    assert [route(r).id for r in reqs] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]
    untagged = [BenchRequest(id=i, at=0, model="m", messages=r.messages, max_tokens=1, tag="turn-1")
                for i, r in enumerate(reqs)]  # fmt: skip
    assert route(untagged[0]) == route(untagged[5]) and {route(r).id for r in untagged} <= {"w0", "w1", "w2"}
    rr = direct_round_robin(workers)
    assert [rr(r).id for r in reqs] == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]
    with pytest.raises(ValueError, match="no ready worker"):
        tenant_affinity([WorkerRef("x", "http://x", state="draining")])


def test_policy_lists() -> None:
    """Client strategies are known policies; rounds rotate the order; an attached run
    measures the client strategies asked for and the gateway once."""
    known, unknown = known_policies(["tenant_affinity", "round_robin", "fleet", "nope"])
    assert known == ["tenant_affinity", "round_robin", "fleet"] and unknown == ["nope"]
    assert rotated(["a", "b", "c"], 1) == ["a", "b", "c"] and rotated(["a", "b", "c"], 2) == ["b", "c", "a"]
    assert attached_policies(["tenant_affinity", "fleet"]) == ["tenant_affinity", "attached"]
    assert attached_policies(["tenant_affinity"]) == ["tenant_affinity"]
    assert attached_policies(["round_robin", "fleet"]) == ["attached"]


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ('{"error": {"message": "full", "type": "rate_limit_error", "param": null, "code": "fleet_overloaded"}}',
         "fleet_overloaded"),
        ('{"error": {"message": "x", "code": null}}', ""),
        ('{"detail": "no"}', ""),
        ("not json", ""),
    ],
)  # fmt: skip
def test_error_code(body: str, code: str) -> None:
    """The `code` of an OpenAI-style error body, "" for anything else."""
    assert error_code(body) == code


def test_summary_routing_figures_and_affinity_ratios() -> None:
    """A run's summary counts 429s by code apart from other errors, herded windows and
    off-majority; ratios are taken against tenant_affinity as well as round-robin."""
    outs = [Outcome(id=i, tag=f"tenant-{i % 2}", at=i / 10, status=200, worker="w0" if i < 10 else f"w{i % 2}",
                    ttft=0.1, e2e=1.0, out_tokens=4, prompt_tokens=100) for i in range(20)]  # fmt: skip
    outs += [Outcome(id=20, tag="tenant-0", at=2.1, status=429, error="http_429", code="fleet_overloaded"),
             Outcome(id=21, tag="tenant-0", at=2.2, status=429, error="http_429", code="fleet_overloaded"),
             Outcome(id=22, tag="tenant-1", at=2.3, status=429, error="http_429"),
             Outcome(id=23, tag="tenant-1", at=2.4, error="transport")]  # fmt: skip
    fleet = summarise("pressure", "fleet", outs, 3.0, {"w0": {"preemptions": 4.0}, "w1": {"preemptions": 6.0}})
    assert fleet["http_429"] == 3 and fleet["http_429_codes"] == {"-": 1, "fleet_overloaded": 2}
    assert fleet["other_errors"] == 1 and fleet["errors"] == 4 and fleet["preemptions"] == 10.0
    assert (fleet["herded_windows"], fleet["windows"]) == (1, 2)
    # tenant-0: 5 + 5 on w0 -> home; tenant-1: 5 on w0, 5 on w1 -> 5 of 20 away.
    assert fleet["off_majority"] == 0.25 and fleet["prompt_tokens_mean"] == 100.0
    # TTFT p50 of the later half of the arrivals: a queue growing through the run.
    growing = [Outcome(id=i, tag="", at=float(i), status=200, worker="w0", ttft=0.1 if i < 5 else 2.0)
               for i in range(10)]  # fmt: skip
    assert summarise("pressure", "x", growing, 10.0, {})["ttft_p50_late"] == 2.0
    oracle = {**fleet, "policy": "tenant_affinity", "ttft_p99": 0.05, "preemptions": 0.0}
    rows = {r["policy"]: r for r in ratios([oracle, fleet], "tenant_affinity")}
    assert rows["fleet"]["ttft_p99"] == pytest.approx(fleet["ttft_p99"] / 0.05) and rows["fleet"]["preemptions"] is None
    text = format_routing([fleet])
    assert "fleet_overloaded 2" in text and "1/2" in text and "25.0%" in text


def _step_measure(limit: float, calls: list[float]):  # type: ignore[no-untyped-def]
    """A fake run whose TTFT p50 is rate / limit x 0.2 s: it passes below `limit`."""

    def measure(rate: float) -> dict[str, object]:
        calls.append(rate)
        return {"ttft_p50": 0.2 * rate / limit, "ttft_p99": 0.5, "errors": 0, "requests": 100}

    return measure


@pytest.mark.parametrize(("start", "limit"), [(4.0, 37.0), (100.0, 37.0), (10.0, 10.5), (8.0, 200.0)])
def test_capacity_search_brackets_then_bisects(start: float, limit: float) -> None:
    """Coarse steps (x2 up, /2 down) bracket the limit, bisection narrows it: the answer
    passes and lies within 1/8 of the bracket under the limit."""
    calls: list[float] = []
    notes: list[str] = []
    rate, steps = find_capacity(_step_measure(limit, calls), start=start, target_p50=0.2, note=notes.append)
    assert rate is not None and rate < limit and rate > limit * (1 - 1 / 8) - 0.2
    assert [s.rate for s in steps] == calls and len(notes) == len(steps) <= 12
    assert all(s.passed == (s.rate < limit) for s in steps)
    assert any("fine" in n for n in notes) and "req/s" in notes[0]


def test_capacity_search_counts_errors_and_gives_up() -> None:
    """A run with more than 1% failed requests (cut at the drain deadline included) does not
    pass, whatever its p50; if even the smallest rate fails there is no capacity rate."""
    def failing(rate: float) -> dict[str, object]:
        return {"ttft_p50": 0.01, "ttft_p99": 0.02, "errors": 2, "requests": 100,
                "error_kinds": {"http_5xx": 2}}  # fmt: skip

    rate, steps = find_capacity(failing, start=4.0, target_p50=0.2, min_rate=1.0)
    assert rate is None and [s.rate for s in steps] == [4.0, 2.0, 1.0]
    assert not passes({"ttft_p50": 0.1, "ttft_p50_late": 0.3, "errors": 0, "requests": 100}, 0.2)
    cut = {"ttft_p50": 0.1, "errors": 2, "requests": 100, "error_kinds": {"timeout": 2}}
    assert not passes(cut, 0.2) and passes({**cut, "errors": 1}, 0.2)
    assert not passes({**cut, "errors": 0, "ttft_p50": 0.2}, 0.2)


def test_tenant_affinity_client_over_a_real_fleet(tmp_path: Path) -> None:
    """Over three real sim workers, the tenant_affinity client sends tenant i's requests to
    worker i % 3 (ids in order): each engine's own count of finished requests says so; the
    direct round-robin client gives each engine a third."""
    spec = FleetSpec(
        model="tiny", time_scale=0.05,
        workers=tuple(WorkerSpec(id=f"w{k}", profile="h100-7b", max_model_len=4096,
                                 options={"num_gpu_blocks": 512}) for k in (2, 0, 1)),
        workloads={"pressure": {"tenants": 5, "system_tokens": 60, "user_tokens": 10, "max_tokens": 4}},
    )  # fmt: skip
    requests = plan(spec, "pressure", BenchOptions(rate=20.0, duration_s=1.5))["requests"]
    assert len(requests) > 10
    expected = Counter(f"w{tenant_of(r.tag) % 3}" for r in requests)  # type: ignore[operator]

    def _sum(text: str, name: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)

    async def finished(workers: list[WorkerRef]) -> dict[str, float]:
        """Each engine's finished requests, read once none runs or waits (an agent's warm-up
        still finishing on a loaded machine would otherwise count as the run's)."""
        async with httpx.AsyncClient(timeout=5) as c:
            deadline = time.monotonic() + 30
            while True:
                texts = {w.id: (await c.get(w.url + "/metrics")).text for w in workers}
                busy = sum(_sum(t, "vllm:num_requests_running") + _sum(t, "vllm:num_requests_waiting")
                           for t in texts.values())
                if not busy or time.monotonic() > deadline:
                    return {wid: _sum(t, "vllm:request_success_total") for wid, t in texts.items()}
                await asyncio.sleep(0.2)

    async def run(route_name: str, workers: list[WorkerRef]) -> tuple[list[Outcome], dict[str, float]]:
        before = await finished(workers)
        route = tenant_affinity(workers) if route_name == "tenant_affinity" else direct_round_robin(workers)
        outcomes, _ = await run_requests(route, requests, drain_s=20)
        after = await finished(workers)
        return outcomes, {w: after[w] - before[w] for w in after}

    with running(spec, tmp_path / "run") as cluster:
        (gw,) = cluster.start_gateways(["round_robin"])

        async def both() -> tuple[tuple[list[Outcome], dict[str, float]], ...]:
            async with httpx.AsyncClient(timeout=10) as c:
                workers = await engines.list_workers(c, gw.url, cluster.admin_token)
            assert [w.id for w in workers] == ["w0", "w1", "w2"]
            return await run("tenant_affinity", workers), await run("direct_round_robin", workers)

        (oracle, oracle_counts), (rr, rr_counts) = asyncio.run(both())
    assert all(not o.error for o in oracle + rr), [o.message for o in oracle + rr if o.error][:3]
    assert oracle_counts == {w: float(n) for w, n in expected.items()} | {
        w: 0.0 for w in ("w0", "w1", "w2") if w not in expected
    }
    assert all(o.worker == f"w{tenant_of(o.tag) % 3}" for o in oracle)  # type: ignore[operator]
    assert max(rr_counts.values()) - min(rr_counts.values()) <= 1 and sum(rr_counts.values()) == len(requests)
    summary = summarise("pressure", "tenant_affinity", oracle, 1.0, {})
    assert summary["off_majority"] == 0.0
    json.dumps(summary)


def test_reset_waits_for_an_idle_vllm_then_empties_its_prefix_cache() -> None:
    """A real vLLM (no /sim/reset) is reset by POST /reset_prefix_cache, only once its
    /metrics show nothing running or waiting; an engine with neither is reported."""
    from aiohttp import web

    calls: list[str] = []
    scrapes = {"n": 0}

    async def metrics(_: web.Request) -> web.Response:
        scrapes["n"] += 1
        running = 1 if scrapes["n"] < 3 else 0
        calls.append(f"metrics running={running}")
        text = (f'vllm:num_requests_running{{model_name="m"}} {running}\n'
                'vllm:num_requests_waiting{model_name="m"} 0\n')  # fmt: skip
        return web.Response(text=text)

    async def reset_cache(_: web.Request) -> web.Response:
        calls.append("reset_prefix_cache")
        return web.Response()

    async def main() -> list[str]:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/reset_prefix_cache", reset_cache)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with httpx.AsyncClient() as c:
                return await engines.reset(c, [WorkerRef("v", f"http://127.0.0.1:{port}"),
                                               WorkerRef("gone", "http://127.0.0.1:1")])  # fmt: skip
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == ["gone"]
    assert calls == ["metrics running=1", "metrics running=1", "metrics running=0", "reset_prefix_cache"]


def _run_file(folder: Path, name: str, **figures: object) -> None:
    run = {"requests": 100, "ttft_p50": 0.1, "ttft_p99": 0.3, "e2e_p99": 1.0, "out_tok_s": 1000.0,
           "http_429": 0, "http_429_codes": {}, "other_errors": 0, "error_kinds": {}, "preemptions": 0.0,
           "prefix_hit_rate": 0.9, "worker_share": {"a": 0.5, "b": 0.5}, "herded_windows": 0, "windows": 10,
           "off_majority": 0.0, "ttft_sorted": [0.1]} | figures  # fmt: skip
    (folder / f"{name}.json").write_text(json.dumps({"runs": [run], "meta": {"rate": 128.0}}))


def test_tables_over_runs_and_issue_checks(tmp_path: Path) -> None:
    """Run files named scenario-strategy-rN become per-run rows, means per cell and the
    issue's checks of `fleet` against tenant_affinity (and round-robin's preemptions)."""
    from fleetgate_tools.bench.tables import checks, load_runs, markdown, means

    for r in (1, 2):
        _run_file(tmp_path, f"pressure-tenant_affinity-r{r}")
        _run_file(tmp_path, f"pressure-round_robin-r{r}", ttft_p50=3.0, ttft_p99=7.0, preemptions=2000.0)
        _run_file(tmp_path, f"pressure-fleet-r{r}", ttft_p50=0.12 if r == 1 else 0.14, ttft_p99=0.4,
                  out_tok_s=990.0, preemptions=50.0)  # fmt: skip
        _run_file(tmp_path, f"skew-tenant_affinity-r{r}", ttft_p99=2.0)
        _run_file(tmp_path, f"skew-fleet-r{r}", ttft_p99=2.5, http_429=3, http_429_codes={"fleet_overloaded": 3})
    (tmp_path / "pressure-fleet-r3.tmp.json").write_text("{}")  # an unfinished run: ignored
    runs = load_runs(tmp_path)
    assert len(runs) == 10 and [r["strategy"] for r in runs[:3]] == ["tenant_affinity"] * 2 + ["round_robin"]
    m = means(runs)
    assert m[("pressure", "fleet")]["ttft_p50"] == pytest.approx(0.13) and m[("pressure", "fleet")]["runs"] == 2
    result = {what: ok for what, ok, _ in checks(m)}
    assert result == {
        "pressure: TTFT p50 <= 1.3x tenant_affinity": True,
        "pressure: TTFT p99 <= 1.5x tenant_affinity": True,
        "pressure: output tok/s >= 0.97x tenant_affinity": True,
        "pressure: preemptions <= 5% of round_robin": True,
        "pressure: zero 429s (mean per run)": True,
        "ample: TTFT p99 <= 1.3x tenant_affinity": None,
        "skew: TTFT p99 below tenant_affinity": False,
    }
    # A baseline that never preempted: fleet's preemptions above zero fail, zero passes.
    zero = {**m, ("pressure", "round_robin"): {**m[("pressure", "round_robin")], "preemptions": 0.0}}
    row = next(c for c in checks(zero) if "preemptions" in c[0])
    assert row[1] is False and row[2] == "50 vs round_robin's 0"
    zero[("pressure", "fleet")] = {**m[("pressure", "fleet")], "preemptions": 0.0}
    assert next(c for c in checks(zero) if "preemptions" in c[0])[1] is True
    text = markdown(runs, {"capacity_rps": 128.0, "strategy": "tenant_affinity", "target_ttft_p50": 0.2, "steps": []})
    assert "capacity rate: 128.0 req/s" in text and "fleet_overloaded 3" in text and "| FAIL |" in text
