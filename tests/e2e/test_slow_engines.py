"""Engines that hang or are slow, on real processes: requests already waiting on a hung engine
move elsewhere as soon as its agent says it is unhealthy, and a slow engine's answers are
waited for as long as what was asked needs, not one fixed figure."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable

import httpx

from tests.conftest import Fleet, children, wait_until

MODEL = "slow-model"


def _chat(url: str, i: int, max_tokens: int = 8, stream: bool = False, timeout: float = 30) -> tuple[int, str, float]:
    body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "messages": [{"role": "user", "content": f"request {i}"}]}
    started = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as resp:
        text = resp.read().decode()
        ok = resp.status_code == 200 and (not stream or ("[DONE]" in text and '"error"' not in text))
        return (200 if ok else resp.status_code), resp.headers.get("x-fleetgate-worker", ""), time.monotonic() - started


def test_requests_waiting_on_a_hung_engine_move_when_it_turns_unhealthy(fleet_factory: Callable[[], Fleet]) -> None:
    """SIGSTOP an engine, then send whole and streamed requests round-robin: those sent to the hung
    engine wait only until its agent publishes it unhealthy (a few seconds), then are answered by
    the other worker, long before their 30 s first-byte limit."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--policy", "round_robin")
    agents = {wid: fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.1") for wid in ("a", "b")}
    fleet.wait_ready(url, "a", "b")
    [engine] = children(agents["a"].pid)
    os.kill(engine, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: _chat(url, i, stream=i % 2 == 1, timeout=25), range(8)))
        gateway_log = "".join(p.output() for p in fleet.procs if "gateway" in p.log_path.name)
    finally:
        os.kill(engine, signal.SIGCONT)
    assert [(status, worker) for status, worker, _ in results] == [(200, "b")] * 8, results
    slowest = max(s for _, _, s in results)
    assert slowest < 10, results
    assert "gateway.waiting_interrupted" in gateway_log
    print(f"hung engine: 8/8 answered by the other worker, slowest {slowest:.1f} s")


def test_a_slow_engines_long_answer_is_waited_for_by_what_was_asked(fleet_factory: Callable[[], Fleet]) -> None:
    """One engine at ~25 tokens a second: a whole 150-token answer (6 s) outlasts the 2 s
    first-byte base, and is still waited for (2 s + 0.1 s a token asked for); a stream's first
    event comes within its limit; a 3-token answer on a hung engine is given up after its own
    short limit."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "first_byte_timeout_s=2", "--set", "retry_attempts=1")
    agent = fleet.worker("a", "--model", MODEL, "--option", "time_scale=1")
    fleet.wait_ready(url, "a")
    engine_url = fleet.workers(url)["a"]["url"]
    assert httpx.post(f"{engine_url}/sim/profile", json={"base_step_s": 0.04}).status_code == 200
    status, _, took = _chat(url, 1, max_tokens=150)
    assert status == 200 and took > 4, took
    status, _, _ = _chat(url, 2, max_tokens=150, stream=True)
    assert status == 200
    # A hung engine (its agent not told yet): a short answer's limit is short.
    [engine] = children(agent.pid)
    os.kill(engine, signal.SIGSTOP)
    try:
        status, _, took = _chat(url, 3, max_tokens=3)
    finally:
        os.kill(engine, signal.SIGCONT)
    assert status >= 500 and took < 4, (status, took)
    wait_until(lambda: fleet.workers(url)["a"]["state"] == "ready", timeout=10)
