"""The overhead benchmark's parts: the stub engine, the load generator, the report, and one tiny run.

No timed assertions: these show the plumbing counts and reports what passes through it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fleetgate.net import free_port
from fleetgate_tools.overhead.loadgen import Job, Result, run_job
from fleetgate_tools.overhead.runner import Measure, Report, merge, pct
from fleetgate_tools.overhead.table import as_json, render, timing_diffs
from tests.conftest import ROOT, wait_until
from workers.engines.vllm import parse_vllm_metrics


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fleetgate_tools.overhead.stub", "--port", str(port)], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, timeout=15)
        yield url
    finally:
        proc.terminate()
        proc.wait(5)


def test_stub_answers_what_an_agent_reads(stub: str) -> None:
    """/v1/models names the model and its context; /metrics parses as vLLM's, all zero."""
    models = httpx.get(stub + "/v1/models").json()["data"]
    assert models[0]["id"] == "stub" and models[0]["max_model_len"] > 0
    load = parse_vllm_metrics(httpx.get(stub + "/metrics").text)
    assert (load.running, load.waiting, load.kv_cache_usage) == (0, 0, 0.0)
    assert httpx.get(stub + "/nope").status_code == 404


def test_stub_completes_and_streams_max_tokens_chunks(stub: str) -> None:
    """A plain answer carries usage; a stream sends max_tokens chunks, one finish_reason, then [DONE]."""
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}
    plain = httpx.post(stub + "/v1/chat/completions", json=body).json()
    assert plain["choices"][0]["message"]["content"] and plain["usage"]["completion_tokens"] > 0
    with httpx.stream("POST", stub + "/v1/completions",
                      json={"model": "stub", "prompt": "hi", "stream": True, "max_tokens": 5}) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert len(events) == 6 and events[-1] == "data: [DONE]"
    assert sum('"finish_reason":"stop"' in e for e in events) == 1


def test_stub_ends_a_stream_with_usage_when_asked_as_vllm_does(stub: str) -> None:
    """stream_options.include_usage (the gateway asks for it on every stream) adds one last
    chunk before [DONE], with no choices and the usage."""
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 3, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", stub + "/v1/chat/completions", json=body) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert len(events) == 5 and events[-1] == "data: [DONE]"
    last = json.loads(events[-2][5:])
    assert last["choices"] == [] and last["usage"]["prompt_tokens"] > 0


def test_stub_stamps_paced_chunks(stub: str) -> None:
    """With a per-chunk delay each chunk carries the stub's send time."""
    body = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 3, "stub_chunk_delay_ms": 1}
    with httpx.stream("POST", stub + "/v1/chat/completions", json=body) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: {")]
    assert len(events) == 3 and all(e.startswith('data: {"stub_sent":') for e in events)


async def test_loadgen_counts_requests_chunks_and_transits(stub: str) -> None:
    """A fixed-count job records every request, its chunks (less [DONE]) and each chunk's transit."""
    res = await run_job(Job(urls=[stub, stub], stream=True, concurrency=2, requests=6, max_tokens=4))
    assert (res.completed, res.total, res.errors, res.chunks) == (6, 6, 0, 24)
    assert len(res.latencies_ms) == len(res.ttfc_ms) == 6
    timed = await run_job(Job(urls=[stub], stream=True, requests=1, max_tokens=4, chunk_delay_ms=1,
                              record_chunks=True))
    assert len(timed.chunk_times_ms) == 1 and len(timed.chunk_times_ms[0]) == 4
    assert all(t >= 0 for t in timed.chunk_times_ms[0])


async def test_loadgen_duration_job_and_errors(stub: str) -> None:
    """A timed job measures inside its window; a 404 counts as an error, not a latency."""
    res = await run_job(Job(urls=[stub], concurrency=4, duration_s=0.3, warmup_s=0.1))
    assert res.completed > 0 and res.total >= res.completed and res.errors == 0
    assert res.window_s == 0.3
    bad = await run_job(Job(urls=[stub], path="/v1/nothing", requests=2))
    assert (bad.completed, bad.errors, bad.first_error) == (0, 2, "HTTP 404")


def test_report_renders_ratios_and_targets() -> None:
    """The report computes ratios against direct and checks every target it has figures for."""
    def m(rps: float, p50: float, cpu: float | None) -> Measure:
        return Measure(rps, p50, p50 * 2, p50, p50 * 2, rps * 64, cpu, 0, 0.1)

    report = Report(["direct", "fleetgate"])
    for mode in ("plain", "stream"):
        for c in (1, 64):
            report.runs[(mode, c, "direct")] = [m(1000, 1.0, None)] * 3
            report.runs[(mode, c, "fleetgate")] = [m(500, 1.5, 0.5), m(600, 1.4, 0.4), m(400, 1.6, 0.6)]
    report.timing = {"direct": [0.2, 0.2], "fleetgate": [0.5, 0.3]}
    text = render(report)
    assert "FAIL  added p50 ms, C=1, non-streaming: 0.500" in text
    assert "FAIL  req/s x direct, C=64, non-streaming: 0.500" in text
    assert "PASS  p99 x direct, C=64, non-streaming: 1.500" in text
    assert "FAIL  chunks/s x direct, C=64, streaming: 0.500" in text
    assert "Scaling over gateway processes" not in text
    assert timing_diffs(report, "fleetgate") == pytest.approx([0.3, 0.1])
    assert as_json(report)["ratios"][0]["rps_ratio"] == 0.5
    assert pct([3.0, 1.0, 2.0], 50) == 2.0 and pct([float(i) for i in range(100)], 99) == 98.0


def test_scaling_table_sets_each_process_count_beside_one() -> None:
    """With gateways of several process counts the report adds the scaling table: each
    count's req/s against direct's and against one process's."""
    report = Report(["direct", "fleetgate", "fleetgate-w2", "vllm-router"])
    for name, rps in (("direct", 1000.0), ("fleetgate", 300.0), ("fleetgate-w2", 540.0), ("vllm-router", 700.0)):
        report.runs[("plain", 64, name)] = [Measure(rps, 5.0, 9.0, 0, 0, 0, None, 0, 0.1)]
    text = render(report).split("Scaling over gateway processes")[1]
    rows = {line.split()[2]: line.split() for line in text.splitlines() if line.startswith("plain")}
    assert rows["fleetgate-w2"][3:5] == ["540", "0.54"] and rows["fleetgate-w2"][-1] == "1.80"
    assert rows["vllm-router"][-1] == "-" and rows["direct"][4] == "1.00"


def test_results_of_several_loadgen_processes_merge() -> None:
    """A job split over load generator processes reads as one: counts add, latencies pool."""
    a = Result(completed=2, total=3, errors=1, first_error="HTTP 500", window_s=1.0, latencies_ms=[1.0, 2.0],
               chunks=4, cpu_s=0.1)
    b = Result(completed=1, total=1, window_s=1.0, latencies_ms=[3.0], chunks=2, cpu_s=0.2)
    got = merge([a, b])
    assert (got.completed, got.total, got.errors, got.first_error, got.chunks) == (3, 4, 1, "HTTP 500", 6)
    assert sorted(got.latencies_ms) == [1.0, 2.0, 3.0] and got.window_s == 1.0
    assert got.cpu_s == pytest.approx(0.3)


def test_benchmark_end_to_end_tiny(tmp_path: Path) -> None:
    """The script brings up stubs, agents and the gateway, runs every mode, and prints the table."""
    out = subprocess.run(
        [sys.executable, "scripts/bench_overhead.py", "--rounds", "1", "--duration", "0.3", "--warmup", "0.1",
         "--concurrency", "2", "--timing-requests", "1", "--chunks", "8", "--no-router",
         "--run-dir", str(tmp_path), "--json", str(tmp_path / "out.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "stream  2  fleetgate" in out.stdout and "Issue 17 targets" in out.stdout
    assert " 0\n" in out.stdout.split("Against direct")[0]  # the errors column
    assert (tmp_path / "out.json").exists()


def test_baseline_checkout_is_measured_beside_this_one(tmp_path: Path) -> None:
    """--baseline DIR: a gateway from another checkout is one more target in the same rounds."""
    base = tmp_path / "base"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), "HEAD"], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        out = subprocess.run(
            [sys.executable, "scripts/bench_overhead.py", "--rounds", "1", "--duration", "0.3", "--warmup", "0.1",
             "--concurrency", "2", "--modes", "plain", "--timing-requests", "0", "--no-router",
             "--baseline", str(base), "--run-dir", str(tmp_path / "run")],
            cwd=ROOT, capture_output=True, text=True, timeout=180,
        )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[2] for line in out.stdout.split("Against direct")[0].splitlines()
            if line.startswith("plain ")}
    assert rows == {"direct", "fleetgate", "baseline"}, out.stdout
    assert '"event":"gateway.request"' in (tmp_path / "run" / "baseline.log").read_text()


@pytest.mark.skipif(not shutil.which("callgrind_control"), reason="valgrind is not installed")
def test_instruction_count_end_to_end_tiny(tmp_path: Path) -> None:
    """scripts/bench_instructions.py runs the gateway under callgrind and counts its requests' instructions."""
    out = subprocess.run(
        [sys.executable, "scripts/bench_instructions.py", "--modes", "plain", "--requests", "40", "--warmup", "10",
         "--concurrency", "2", "--run-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.split()[:2] == ["plain", "fleetgate"])
    ir = int(row.split()[2].replace(",", ""))
    assert 50_000 < ir < 50_000_000, row  # a request is hundreds of thousands of instructions, not zero
