"""What the benchmark reads from (and does to) the engines behind a gateway.

Worker URLs come from the gateway's `GET /admin/workers`. Counters are read from each
engine's own /metrics, before and after a run, and reported as deltas: prefix-cache hits
and queries in tokens (vLLM's names, or LMDeploy's cached/prompt token counters), the
simulator's `fleetgate_sim:lora_loads_total` (adapter weights entering a LoRA slot:
first use or swap-in after an eviction) and `fleetgate_sim:lora_api_loads_total`
(runtime loads through /v1/load_lora_adapter), and preemptions.

While a run is in flight, `LoadSampler` reads every engine's own gauges twice a second
(requests running and waiting, KV cache use) and `load_stats` sums them up: the engines'
view of the run beside what the client saw.

Before a run every engine is made cold: a simulator by `POST /sim/reset`, a real vLLM by
`POST /reset_prefix_cache` (served with VLLM_SERVER_DEV_MODE=1) once its /metrics show
nothing running or waiting (vLLM leaves blocks that are still in use cached).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from fleetgate_tools.bench.lora import LoraInfo, LoraSample, parse_lora_info

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
    kv_tokens: int = 0  # the KV cache's size in tokens, as the agent registered it (0: unknown)
    # Its engine's KV cache events as the gateway mirrors them: "events" (an index it can
    # trust), "lost" (not now), "" (it publishes none).
    kv_events: str = ""


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
        (WorkerRef(w["id"], w["url"], w.get("engine", ""), w.get("state", ""), int(w.get("kv_tokens") or 0),
                   str((w.get("kv_events") or {}).get("state") or ""))
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


# ---------------------------------------------------------------- load during a run

# Gauge -> the sample names that carry it (summed over their label sets), first found wins.
GAUGES: Mapping[str, tuple[str, ...]] = {
    "running": ("vllm:num_requests_running", "lmdeploy:num_requests_running"),
    "waiting": ("vllm:num_requests_waiting", "lmdeploy:num_requests_waiting"),
    "kv": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}
_GAUGE_LINE = re.compile(
    r"^(" + "|".join(re.escape(n) for names in GAUGES.values() for n in names) + r")(?:\{[^}]*\})? (\S+)$",
    re.M,
)


def parse_gauges(text: str) -> dict[str, float]:
    """running / waiting / kv (0..1) from one /metrics text; absent ones left out. A regex
    over the text, not a full parse: this runs twice a second per engine during a run."""
    sums: dict[str, float] = {}
    for m in _GAUGE_LINE.finditer(text):
        try:
            value = float(m[2])
        except ValueError:
            continue
        if value == value:  # not NaN
            sums[m[1]] = sums.get(m[1], 0.0) + value
    out = {}
    for key, names in GAUGES.items():
        for name in names:
            if name in sums:
                out[key] = sums[name]
                break
    return out


# One sample: seconds since the sampler started, and each engine's gauges at that time.
Sample = tuple[float, dict[str, dict[str, float]]]


class LoadSampler:
    """Reads every engine's gauges every `interval_s` until stopped (`async with`); where an
    engine exports `vllm:lora_requests_info`, its adapter state too (`lora_samples`)."""

    def __init__(self, client: httpx.AsyncClient, workers: Sequence[WorkerRef], interval_s: float = 0.5) -> None:
        self.client, self.workers, self.interval_s = client, list(workers), interval_s
        self.samples: list[Sample] = []
        self.lora_samples: list[LoraSample] = []
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self._stop = asyncio.Event()

    async def __aenter__(self) -> LoadSampler:
        self._t0 = time.perf_counter()
        if self.workers:
            self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Stop after the round of reads under way, if any: every read the engines answered is
        a sample (a read cut off halfway would have counted on the engine and not here)."""
        if self._task:
            self._stop.set()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _one(self, w: WorkerRef) -> tuple[str, dict[str, float], LoraInfo | None]:
        try:
            resp = await self.client.get(w.url + "/metrics", timeout=2)
        except httpx.HTTPError:
            return w.id, {}, None
        if resp.status_code != 200:
            return w.id, {}, None
        return w.id, parse_gauges(resp.text), parse_lora_info(resp.text)

    async def _run(self) -> None:
        while True:
            t = time.perf_counter() - self._t0
            got = await asyncio.gather(*(self._one(w) for w in self.workers))
            self.samples.append((round(t, 3), {wid: g for wid, g, _ in got if g}))
            loras = {wid: info for wid, _, info in got if info is not None}
            if loras:
                self.lora_samples.append((round(t, 3), loras))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(),
                                       max(0.0, self.interval_s - (time.perf_counter() - self._t0 - t)))
            if self._stop.is_set():
                return


def load_stats(samples: Sequence[Sample], window_s: float | None = None) -> dict[str, Any]:
    """The engines' own figures over a run's samples: the fleet's requests waiting (max) and
    running (mean, max), summed over its engines; KV use (mean over the engines; its mean
    and the highest any engine reached). Means are over the samples taken while requests
    still arrived (t <= window_s, when given), maxima over all. Per engine too."""
    seen = [(t, s) for t, s in samples if s]
    keys = ("eng_waiting_max", "eng_waiting_mean", "eng_running_mean", "eng_running_max", "eng_kv_mean", "eng_kv_max")
    if not seen:
        return {k: None for k in keys} | {"eng_samples": 0, "eng_load": {}}
    inside = [(t, s) for t, s in seen if window_s is None or t <= window_s] or seen

    def fleet(sample: dict[str, dict[str, float]], key: str) -> float:
        return sum(g.get(key, 0.0) for g in sample.values())

    def kv_mean(sample: dict[str, dict[str, float]]) -> float | None:
        vals = [g["kv"] for g in sample.values() if "kv" in g]
        return statistics.fmean(vals) if vals else None

    kv_in = [v for _, s in inside if (v := kv_mean(s)) is not None]
    kv_all = [g["kv"] for _, s in seen for g in s.values() if "kv" in g]
    per: dict[str, dict[str, float | None]] = {}
    for wid in sorted({w for _, s in seen for w in s}):
        mine = [s[wid] for _, s in inside if wid in s]
        every = [s[wid] for _, s in seen if wid in s]
        kvs = [g["kv"] for g in mine if "kv" in g]
        per[wid] = {
            "running_mean": round(statistics.fmean(g.get("running", 0.0) for g in mine), 2) if mine else None,
            "running_max": max(g.get("running", 0.0) for g in every),
            "waiting_max": max(g.get("waiting", 0.0) for g in every),
            "kv_mean": round(statistics.fmean(kvs), 4) if kvs else None,
            "kv_max": max((g["kv"] for g in every if "kv" in g), default=None),
        }
    return {
        "eng_waiting_max": max(fleet(s, "waiting") for _, s in seen),
        "eng_waiting_mean": round(statistics.fmean(fleet(s, "waiting") for _, s in inside), 2),
        "eng_running_mean": round(statistics.fmean(fleet(s, "running") for _, s in inside), 2),
        "eng_running_max": max(fleet(s, "running") for _, s in seen),
        "eng_kv_mean": round(statistics.fmean(kv_in), 4) if kv_in else None,
        "eng_kv_max": max(kv_all) if kv_all else None,
        "eng_samples": len(seen),
        "eng_load": per,
    }
