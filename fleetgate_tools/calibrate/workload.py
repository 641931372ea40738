"""The workload both engines get: token-id prompts (the same tokens on both sides),
`ignore_eos` and a fixed max_tokens (exact output counts), closed-loop clients at 1, 4 and
16, and prompts sharing a 512-token head for the prefix cache's counters."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleetgate_tools.bench.report import percentile
from fleetgate_tools.calibrate.engines import MAX_SEQS, Engine

PROMPT = 256
OUT = 64
PREFIX = 512

# (clients, requests per client, max_tokens) of each group
GROUPS: dict[str, tuple[int, int, int]] = {
    "c1": (1, 8, OUT),
    "c4": (4, 4, OUT),
    "c16": (16, 3, OUT),
}
ADMIT = (4, 6, 1)  # fit only: requests of one token, for the front-end's per-request cost


def _metrics(text: str) -> dict[str, tuple[dict[str, str], float]]:
    out: dict[str, tuple[dict[str, str], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels, value = out.get(s.name, (dict(s.labels), 0.0))
            out[s.name] = (labels, value + s.value)
    return out


async def _stream(
    client: httpx.AsyncClient, url: str, ids: list[int], out: int
) -> tuple[float, float]:
    """(ttft, e2e) of one streamed completion."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": out, "ignore_eos": True, "stream": True,
            "temperature": 0.0}  # fmt: skip
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith("data: ") and '"text"' in line:
                ttft = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return ttft or end, end


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(300, vocab) for _ in range(length)] for _ in range(n)]


async def closed_loop(
    engine: Engine, shape: tuple[int, int, int], seed: int, vocab: int
) -> dict[str, float]:
    """`clients` users, each sending its requests back to back; figures plus CPU use."""
    clients, per_client, out = shape
    prompts = _prompts(seed, clients * per_client, PROMPT, vocab)
    results: list[tuple[float, float]] = []
    peak = 0.0
    async with httpx.AsyncClient(timeout=300) as client:

        async def user(k: int) -> None:
            for j in range(per_client):
                results.append(await _stream(client, engine.url, prompts[k * per_client + j], out))

        async def watch() -> None:
            # Sparse and cheap: vLLM renders /metrics in ~6 ms of its front-end's CPU and
            # the full text takes this script longer to parse; at 10 Hz that slowed vLLM's
            # steps (and fattened its TTFT tail) where it does not slow the simulator's.
            nonlocal peak
            while True:
                text = (await client.get(engine.url + "/metrics")).text
                waiting = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("vllm:num_requests_waiting{")
                )
                peak = max(peak, waiting)
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch()) if clients > MAX_SEQS else None
        window = engine.cpu_window()
        await asyncio.gather(*(user(k) for k in range(clients)))
        cpu = window.close()
        if watcher:
            watcher.cancel()
    ttfts = [r[0] for r in results]
    e2e = percentile([r[1] for r in results], 50) or 1.0
    tag = f"c{clients}"
    figures = {
        f"ttft_p50_{tag}": percentile(ttfts, 50) or 0.0,
        # ignore_eos + max_tokens: exactly `out` tokens each. Little's law over the median
        # request (a closed loop keeps `clients` in flight).
        f"tok_s_{tag}": clients * out / e2e,
        f"tpot_{tag}": statistics.median((e - t) / max(out - 1, 1) for t, e in results),
        "requests": float(len(results)),
        "tokens": float(len(results) * out),
        **cpu,
    }
    if clients > MAX_SEQS:
        figures["overload_peak_waiting"] = peak
        figures["overload_ttft_p90"] = percentile(ttfts, 90) or 0.0
    return figures


async def prefix_counts(engine: Engine, vocab: int) -> dict[str, float]:
    """The engine's own prefix-cache hits and queries over sequential prompts sharing a
    PREFIX-token head (counter deltas: exact), and its KV blocks and block size."""
    async with httpx.AsyncClient(timeout=300) as client:
        before = _metrics((await client.get(engine.url + "/metrics")).text)
        head = _prompts(7, 1, PREFIX, vocab)[0]
        for tail in _prompts(8, 6, 64, vocab):
            await _stream(client, engine.url, head + tail, 8)
        after = _metrics((await client.get(engine.url + "/metrics")).text)
    figures = {}
    for key in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
        name = "vllm:" + key
        figures[key.replace("_total", "")] = (
            after.get(name, ({}, 0))[1] - before.get(name, ({}, 0))[1]
        )
    info = after.get("vllm:cache_config_info", ({}, 0))[0]
    figures["num_gpu_blocks"] = float(info.get("num_gpu_blocks") or 0)
    figures["block_size"] = float(info.get("block_size") or 0)
    return figures
