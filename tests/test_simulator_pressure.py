"""The simulator under KV pressure, as vLLM V1 behaves there: admission by free blocks,
recompute preemption, LRU eviction of cached prefix blocks, and load gauges published at
the end of each step. First the scheduler stepped by hand, then real processes over HTTP.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.test_simulator import _sched, _seq, _submit, start
from workers.engines.sim import SimEngine


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


# --- over HTTP --------------------------------------------------------------------------
async def test_waiting_gauge_is_zero_without_pressure() -> None:
    """Requests that arrive while a step runs are not counted as waiting: with one long
    request decoding and short ones sent one after another, every scrape reads waiting 0."""
    server = start("--profile", "h200-7b", "--time-scale", "1")
    engine = SimEngine()
    seen = []
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            long = asyncio.create_task(client.post(server.url + "/v1/completions", json={
                "model": "base", "prompt": "hold", "max_tokens": 60, "ignore_eos": True}))  # fmt: skip

            async def scrape() -> None:
                while not long.done():
                    text = (await client.get(server.url + "/metrics")).text
                    seen.append(engine.parse_metrics(text))
                    await asyncio.sleep(0.002)

            scraper = asyncio.create_task(scrape())
            for i in range(15):
                body = {"model": "base", "prompt": f"short {i}", "max_tokens": 2}
                assert (await client.post(server.url + "/v1/completions", json=body)).is_success
            await long
            await scraper
    finally:
        server.stop()
    assert len(seen) > 50 and max(x.running for x in seen) >= 2
    assert all(x.waiting == 0 for x in seen)
