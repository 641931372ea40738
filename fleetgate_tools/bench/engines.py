"""What the benchmark reads from (and does to) the engines behind a gateway.

Worker URLs come from the gateway's `GET /admin/workers`. Counters are read from each
engine's own /metrics, before and after a run, and reported as deltas: prefix-cache hits
and queries in tokens (vLLM's names, or LMDeploy's cached/prompt token counters), the
simulator's `fleetgate_sim:lora_loads_total` (adapter weights entering a LoRA slot:
first use or swap-in after an eviction) and `fleetgate_sim:lora_api_loads_total`
(runtime loads through /v1/load_lora_adapter), and preemptions.

Before a run every engine is made cold: a simulator by `POST /sim/reset`, a real vLLM by
`POST /reset_prefix_cache` (served with VLLM_SERVER_DEV_MODE=1) once its /metrics show
nothing running or waiting (vLLM leaves blocks that are still in use cached).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

# Counter -> the sample names that carry it, first found wins.
COUNTERS: Mapping[str, tuple[str, ...]] = {
    "prefix_hits": ("vllm:prefix_cache_hits_total", "lmdeploy:cached_tokens_total"),
    "prefix_queries": ("vllm:prefix_cache_queries_total", "lmdeploy:prompt_tokens_total"),
    "lora_loads": ("fleetgate_sim:lora_loads_total",),
    "lora_api_loads": ("fleetgate_sim:lora_api_loads_total",),
    "preemptions": ("vllm:num_preemptions_total",),
}


class WorkerRef(msgspec.Struct, frozen=True):
    id: str
    url: str
    engine: str = ""
    state: str = ""  # the registry's: ready, draining, ... ("" when not given)


def parse_counters(text: str) -> dict[str, float]:
    """The COUNTERS from one /metrics text (absent ones are left out)."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    out = {}
    for key, names in COUNTERS.items():
        for name in names:
            if name in sums:
                out[key] = sums[name]
                break
    return out


async def list_workers(client: httpx.AsyncClient, gateway: str, admin_token: str) -> list[WorkerRef]:
    resp = await client.get(gateway + "/admin/workers",
                            headers={"authorization": f"Bearer {admin_token}"})  # fmt: skip
    resp.raise_for_status()
    return sorted(
        (WorkerRef(w["id"], w["url"], w.get("engine", ""), w.get("state", ""))
         for w in resp.json()["data"]),
        key=lambda w: w.id,
    )


async def scrape(client: httpx.AsyncClient, workers: list[WorkerRef]) -> dict[str, dict[str, float]]:
    async def one(w: WorkerRef) -> tuple[str, dict[str, float]]:
        try:
            resp = await client.get(w.url + "/metrics", timeout=5)
            return w.id, parse_counters(resp.text) if resp.status_code == 200 else {}
        except httpx.HTTPError:
            return w.id, {}

    return dict(await asyncio.gather(*(one(w) for w in workers)))


def deltas(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for wid, values in after.items():
        prev = before.get(wid, {})
        out[wid] = {k: v - prev.get(k, 0.0) for k, v in values.items()}
    return out


BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def busy(text: str) -> float:
    """Requests running or waiting, from one vLLM /metrics text."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in BUSY_GAUGES:
                total += sample.value
    return total


async def reset(client: httpx.AsyncClient, workers: list[WorkerRef], wait_s: float = 15.0) -> list[str]:
    """Empty every engine's prefix cache (and a simulator's LoRA slots), waiting while one
    is still busy; returns the ids of the workers that could not be reset."""

    async def one(w: WorkerRef) -> str | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                resp = await client.post(w.url + "/sim/reset", timeout=5)
            except httpx.HTTPError:
                return w.id
            if resp.status_code == 200:
                return None
            if resp.status_code == 404:
                return await _reset_vllm(client, w, deadline)
            if resp.status_code != 409 or loop.time() > deadline:
                return w.id
            await asyncio.sleep(0.2)

    return [wid for wid in await asyncio.gather(*(one(w) for w in workers)) if wid]


async def _reset_vllm(client: httpx.AsyncClient, w: WorkerRef, deadline: float) -> str | None:
    loop = asyncio.get_running_loop()
    try:
        while loop.time() < deadline:
            resp = await client.get(w.url + "/metrics", timeout=5)
            if resp.status_code != 200 or not busy(resp.text):
                break
            await asyncio.sleep(0.25)
        resp = await client.post(w.url + "/reset_prefix_cache", timeout=10)
    except httpx.HTTPError:
        return w.id
    return None if resp.status_code == 200 else w.id


async def wait_idle(client: httpx.AsyncClient, gateway: str, admin_token: str, wait_s: float = 6.0) -> bool:
    """Wait until the gateway reports nothing in flight on any worker (its own and other
    replicas' leased counts); False if that did not happen within wait_s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline:
        try:
            resp = await client.get(gateway + "/admin/workers",
                                    headers={"authorization": f"Bearer {admin_token}"})  # fmt: skip
            data = resp.json()["data"]
            if all(not (w.get("load") or {}).get("inflight") for w in data):
                return True
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(0.2)
    return False
