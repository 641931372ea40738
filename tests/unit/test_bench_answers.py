"""Issue 31's benchmark pieces: the `pressure_long` workload (max_tokens far above the answer),
how an answer ends (the client's cut, or vLLM's min_tokens + EOS bias), the engines' own
gauges sampled during a run, and the tables that print them beside every row."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from fleetgate_tools.bench.arrivals import arrivals, poisson_arrivals
from fleetgate_tools.bench.engines import LoadSampler, WorkerRef, load_stats, parse_gauges
from fleetgate_tools.bench.fleet import FleetSpec, WorkerSpec, capacity, load_fleet
from fleetgate_tools.bench.loadgen import Outcome, run_requests
from fleetgate_tools.bench.report import format_routing, format_table, summarise
from fleetgate_tools.bench.runner import BenchOptions, plan
from fleetgate_tools.bench.workloads import (
    BenchRequest,
    FleetFacts,
    contents,
    read_trace,
    write_trace,
)

ROOT = Path(__file__).resolve().parents[2]
FACTS = FleetFacts(model="m")


def _req(d, i: int = 0) -> BenchRequest:  # type: ignore[no-untyped-def]
    return BenchRequest(id=i, at=0.0, model=d.model, messages=d.messages, max_tokens=d.max_tokens, tag=d.tag,
                        ignore_eos=d.ignore_eos, answer_tokens=d.answer_tokens, extra=d.extra)  # fmt: skip


def test_pressure_long_declares_4096_and_is_cut_by_the_client() -> None:
    """pressure_long: the pressure workload's prompts and tenants, max_tokens 4096, no
    ignore_eos, and the client reads 64 tokens; nothing else in the body (the same request
    on the simulator and on vLLM). Poisson arrivals, like pressure."""
    drafts = list(itertools.islice(contents("pressure_long", 0, FACTS), 200))
    assert {d.max_tokens for d in drafts} == {4096} and {d.answer_tokens for d in drafts} == {64}
    assert not any(d.ignore_eos for d in drafts) and not any(d.extra for d in drafts)
    assert {d.tag for d in drafts} == {f"tenant-{i}" for i in range(16)}
    body = _req(drafts[0]).body()
    assert body["max_tokens"] == 4096 and body["ignore_eos"] is False and body["stream"] is True
    assert "min_tokens" not in body and "logit_bias" not in body
    assert arrivals("pressure_long", 20.0, 50.0, 3) == poisson_arrivals(20.0, 50.0, 3)
    # The pressure workload itself is unchanged: exact answers of max_tokens.
    (p,) = itertools.islice(contents("pressure", 0, FACTS), 1)
    assert p.ignore_eos and p.answer_tokens == 0 and _req(p).body()["ignore_eos"] is True


def test_pressure_long_engine_end_asks_vllm_to_stop_at_the_answer() -> None:
    """answer_end engine: min_tokens = answer - 1 masks EOS until then, logit_bias +100 on
    the EOS id makes it the next token; the client only cuts past a guard."""
    params = {"answer_end": "engine", "eos_token_id": 7, "answer_tokens": 32, "max_tokens": 1024}
    (d,) = itertools.islice(contents("pressure_long", 0, FACTS, params), 1)
    body = _req(d).body()
    assert body["min_tokens"] == 31 and body["logit_bias"] == {"7": 100} and body["ignore_eos"] is False
    assert body["max_tokens"] == 1024 and d.answer_tokens == 32 + 16
    for bad in ({"answer_end": "never"}, {"answer_tokens": 4096}):
        with pytest.raises(ValueError):
            next(contents("pressure_long", 0, FACTS, bad))


def test_answer_fields_round_trip_a_trace(tmp_path: Path) -> None:
    """A trace keeps how each answer ends; old traces (without the fields) read as exact."""
    spec = FleetSpec(model="m", workers=(WorkerSpec(id="w"),),
                     workloads={"pressure_long": {"answer_end": "engine"}})  # fmt: skip
    reqs = plan(spec, "pressure_long", BenchOptions(rate=10.0, duration_s=2.0))["requests"]
    write_trace(tmp_path / "t.jsonl", reqs)
    assert read_trace(tmp_path / "t.jsonl") == reqs and reqs[0].extra["min_tokens"] == 63
    old = {"id": 0, "at": 0.0, "model": "m", "messages": [], "max_tokens": 8}
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
    (r,) = read_trace(tmp_path / "old.jsonl")
    assert r.ignore_eos and r.answer_tokens == 0 and r.extra == {}


def test_capacity_counts_the_answer_not_max_tokens() -> None:
    """The capacity estimate of pressure_long is the one of 64-token answers, not 4096."""
    spec = load_fleet(ROOT / "config/bench/pressure.yaml")
    short = list(itertools.islice(contents("pressure", 0, spec.facts, spec.workloads["pressure"]), 50))
    long = list(itertools.islice(contents("pressure_long", 0, spec.facts, spec.workloads["pressure_long"]), 50))
    assert {d.max_tokens for d in long} == {4096}
    assert capacity(spec, long) == pytest.approx(capacity(spec, short), rel=0.05)


def test_pressure3_fleet() -> None:
    """config/bench/pressure3.yaml: three pressure.yaml workers, 24 tenants."""
    spec = load_fleet(ROOT / "config/bench/pressure3.yaml")
    assert [w.id for w in spec.workers] == ["w0", "w1", "w2"] and spec.time_scale == 4.0
    assert all(w.option("num_gpu_blocks") == 2106 and w.profile == "h200-7b" for w in spec.workers)
    reqs = plan(spec, "pressure", BenchOptions(rate=44.0, duration_s=10.0))["requests"]
    assert {r.tag for r in reqs} == {f"tenant-{i}" for i in range(24)}


async def _sse_server(tokens: int, finish: str, seen: dict[str, object]) -> tuple[web.AppRunner, str]:
    """A chat endpoint streaming `tokens` chunks (then `finish`), noting whether the client
    stayed to the end."""

    async def chat(request: web.Request) -> web.StreamResponse:
        seen["body"] = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(tokens):
                chunk = {"choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                await asyncio.sleep(0.01)
            last = {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                    "usage": {"completion_tokens": tokens, "prompt_tokens": 3}}  # fmt: skip
            await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
            seen["finished"] = True
        except (ConnectionResetError, asyncio.CancelledError):
            seen["gone"] = True
            raise
        return resp

    app = web.Application(handler_args={"handler_cancellation": True})
    app.router.add_post("/v1/chat/completions", chat)
    return await _serve(app, handler_cancellation=True)


async def _serve(app: web.Application, **kwargs: bool) -> tuple[web.AppRunner, str]:
    """`app` on a free loopback port: its runner (to clean up) and its URL."""
    runner = web.AppRunner(app, **kwargs)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize(("tokens", "finish", "answer", "ends", "out"),
                         [(200, "length", 5, "cut", 5), (3, "stop", 5, "stop", 3), (4, "length", 0, "length", 4)])  # fmt: skip
def test_the_client_hangs_up_after_answer_tokens(tokens: int, finish: str, answer: int, ends: str, out: int) -> None:
    """A request with answer_tokens is read that far, then its connection is closed (the
    server sees the client go); an engine that ends earlier keeps its own finish_reason."""
    seen: dict[str, object] = {}

    async def main() -> Outcome:
        runner, url = await _sse_server(tokens, finish, seen)
        try:
            req = BenchRequest(id=0, at=0.0, model="m", messages=[{"role": "user", "content": "hi"}],
                               max_tokens=4096, ignore_eos=False, answer_tokens=answer)  # fmt: skip
            (outcome,), _ = await run_requests(url, [req], drain_s=5)
            await asyncio.sleep(0.3)  # the server's handler notices the disconnect
            return outcome
        finally:
            await runner.cleanup()

    outcome = asyncio.run(main())
    assert not outcome.error and outcome.finish == ends and outcome.out_tokens == out
    assert seen["body"]["ignore_eos"] is False  # type: ignore[index]
    assert seen.get("gone", False) is (ends == "cut") and seen.get("finished", False) is (ends != "cut")


METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m7"} 12.0
vllm:num_requests_waiting{engine="0",model_name="m7"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m7",reason="capacity"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="m7"} 0.5
vllm:num_preemptions_total{engine="0",model_name="m7"} 4.0
"""


def test_parse_gauges() -> None:
    """running / waiting / KV use from vLLM's names (not the by-reason split), summed over
    label sets; the older gpu_cache_usage_perc name too; NaN and junk ignored."""
    assert parse_gauges(METRICS) == {"running": 12.0, "waiting": 3.0, "kv": 0.5}
    two = METRICS + 'vllm:num_requests_running{engine="1",model_name="m7"} 2\n'
    assert parse_gauges(two)["running"] == 14.0
    assert parse_gauges("vllm:gpu_cache_usage_perc 0.25\nvllm:num_requests_waiting NaN\n") == {"kv": 0.25}
    assert parse_gauges("") == {}


def test_load_stats() -> None:
    """Waiting and running are summed over the engines; means over the samples while
    requests arrived, maxima over all; KV is the mean over the engines."""
    samples = [
        (0.0, {"a": {"running": 2, "waiting": 0, "kv": 0.2}, "b": {"running": 4, "waiting": 1, "kv": 0.4}}),
        (0.5, {"a": {"running": 6, "waiting": 5, "kv": 0.6}, "b": {"running": 0, "waiting": 0, "kv": 0.0}}),
        (1.0, {}),  # no engine answered
        (9.0, {"a": {"running": 20, "waiting": 30, "kv": 1.0}}),  # after the arrivals
    ]
    s = load_stats(samples, window_s=1.0)
    assert s["eng_waiting_max"] == 30 and s["eng_running_max"] == 20
    assert s["eng_running_mean"] == 6.0 and s["eng_waiting_mean"] == 3.0
    assert s["eng_kv_mean"] == pytest.approx(0.3) and s["eng_kv_max"] == 1.0 and s["eng_samples"] == 3
    assert s["eng_load"]["a"]["running_mean"] == 4.0 and s["eng_load"]["b"]["waiting_max"] == 1
    empty = load_stats([(0.0, {})], 1.0)
    assert empty["eng_running_mean"] is None and empty["eng_samples"] == 0


def test_load_sampler_reads_engines_during_a_run() -> None:
    """The sampler reads each engine's /metrics until it is stopped; an engine that does not
    answer leaves no gauges."""
    hits = {"n": 0}

    async def metrics(_: web.Request) -> web.Response:
        hits["n"] += 1
        return web.Response(text=METRICS)

    async def main() -> list:  # type: ignore[type-arg]
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner, url = await _serve(app)
        try:
            async with httpx.AsyncClient() as c:
                workers = [WorkerRef("v", url), WorkerRef("gone", "http://127.0.0.1:1")]
                async with LoadSampler(c, workers, interval_s=0.05) as sampler:
                    await asyncio.sleep(0.3)
            return sampler.samples
        finally:
            await runner.cleanup()

    samples = asyncio.run(main())
    assert len(samples) >= 3 and hits["n"] == len(samples)
    assert all(s == {"v": {"running": 12.0, "waiting": 3.0, "kv": 0.5}} for _, s in samples)
    assert load_stats(samples)["eng_running_mean"] == 12.0


def test_rows_carry_ok_sent_429s_and_the_engines_figures() -> None:
    """Every row of the console tables: ok/sent, 429s, and the engines' waiting max,
    running mean/max and KV mean; how the answers ended."""
    outs = [Outcome(id=i, tag="tenant-0", at=0.1 * i, status=200, worker="w0", ttft=0.1, e2e=1.0, out_tokens=64,
                    finish="cut" if i % 2 else "stop") for i in range(10)]  # fmt: skip
    outs.append(Outcome(id=10, tag="tenant-1", at=1.0, status=429, error="http_429", code="fleet_overloaded"))
    run = summarise("pressure_long", "fleet", outs, 2.0, {"w0": {"preemptions": 3.0}},
                    eng_waiting_max=0.0, eng_running_mean=41.4, eng_running_max=77.0, eng_kv_mean=0.382)  # fmt: skip
    assert run["finish"] == {"cut": 5, "stop": 5} and run["out_tokens_mean"] == 64.0
    text = format_table([run])
    assert "ok/sent" in text and "10/11" in text and "41/77" in text and "38.2%" in text and "eng wait max" in text
    assert "cut 5, stop 5" in format_routing([run])
    bare = format_table([summarise("pressure", "x", outs[:2], 1.0, {})])
    assert "2/2" in bare


def test_tables_name_the_new_scenarios_and_print_engine_columns(tmp_path: Path) -> None:
    """half, three, long and longcut runs are read; the rows carry the engines' figures and
    the issue's checks of `fleet` (zero 429s, TTFT p50 against tenant_affinity)."""
    from fleetgate_tools.bench.tables import checks, load_runs, markdown, means

    def run_file(name: str, **figures: object) -> None:
        run = {"workload": "pressure", "requests": 100, "ok": 100, "ttft_p50": 0.1, "ttft_p99": 0.3,
               "e2e_p99": 1.0, "out_tok_s": 1000.0, "http_429": 0, "http_429_codes": {}, "other_errors": 0,
               "error_kinds": {}, "preemptions": 0.0, "prefix_hit_rate": 0.9,
               "worker_share": {"a": 0.5, "b": 0.5}, "herded_windows": 0, "windows": 10, "off_majority": 0.0,
               "eng_waiting_max": 2.0, "eng_running_mean": 40.0, "eng_running_max": 70.0, "eng_kv_mean": 0.4,
               "ttft_sorted": [0.1]} | figures  # fmt: skip
        (tmp_path / f"{name}.json").write_text(json.dumps({"runs": [run], "meta": {"rate": 128.0}}))

    for sc in ("half", "three", "long", "longcut"):
        run_file(f"{sc}-tenant_affinity-r1")
    run_file("long-fleet-r1", workload="pressure_long", ok=60, http_429=40, ttft_p50=9.3,
             http_429_codes={"fleet_overloaded": 40}, eng_waiting_max=0.0, finish={"stop": 60})  # fmt: skip
    run_file("three-fleet-r1", worker_share={"a": 0.3, "b": 0.3, "c": 0.4})
    runs = load_runs(tmp_path)
    assert [r["scenario"] for r in runs] == ["long", "long", "longcut", "half", "three", "three"]
    result = {what: ok for what, ok, _ in checks(means(runs))}
    assert result["long: zero 429s (mean per run)"] is False
    assert result["long: TTFT p50 <= 1.3x tenant_affinity"] is False
    assert result["three: zero 429s (mean per run)"] is True and result["half: zero 429s (mean per run)"] is None
    text = markdown(runs)
    assert "| long | fleet | 1 | 128 | 60/100 | fleet_overloaded 40 |" in text
    assert "eng running mean / max" in text and "40 / 70" in text and "stop 60" in text
    assert "- three: workload pressure at 128 req/s, 2/3 engines" in text


def test_a_request_that_waits_for_the_clients_pool_is_marked() -> None:
    """The load generator's own pool is not the system under test: a request sent while the
    pool's connections are all open is marked `pool_full`, and its wait shows in its TTFT;
    with the default pool the same requests go out at once."""
    release = asyncio.Event()
    started: list[float] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        started.append(asyncio.get_running_loop().time())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await release.wait()
        chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    async def main(pool: int | None) -> tuple[list[Outcome], int]:
        started.clear()
        release.clear()
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner, url = await _serve(app)
        reqs = [BenchRequest(id=i, at=0.0, model="m", messages=[{"role": "user", "content": "hi"}],
                             max_tokens=1, ignore_eos=False) for i in range(3)]  # fmt: skip
        try:
            kwargs = {} if pool is None else {"pool": pool}
            sending = asyncio.create_task(run_requests(url, reqs, drain_s=5, **kwargs))
            for _ in range(200):
                if len(started) >= min(3, pool or 3):
                    break
                await asyncio.sleep(0.01)
            at_once = len(started)
            await asyncio.sleep(0.3)
            release.set()
            outcomes, _ = await sending
        finally:
            await runner.cleanup()
        return outcomes, at_once

    outcomes, at_once = asyncio.run(main(2))
    assert at_once == 2
    assert [o.pool_full for o in outcomes] == [False, False, True]
    assert all(o.error == "" for o in outcomes)
    # The third waited for a connection: its latency counts from its arrival.
    assert outcomes[2].ttft is not None and outcomes[2].ttft >= 0.3
    outcomes, at_once = asyncio.run(main(None))
    assert at_once == 3
    assert not any(o.pool_full for o in outcomes)
