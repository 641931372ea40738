"""The scaling signal (gateway/api/scaling.py): per-model outstanding work, queue, KV use and
saturation, from the gateway's own account; as pure code, as Prometheus series, and on a
live gateway (`/metrics` and `GET /admin/scaling`) under real load."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.schema import WorkerInfo, WorkerView
from gateway.accounts.admission import Admission
from gateway.api.scaling import (
    KV_USE_RATIO,
    OUTSTANDING,
    QUEUE_DEPTH,
    SATURATION,
    ModelSignal,
    ScalingCollector,
    signals,
)
from tests.conftest import Fleet, wait_until


def view(worker_id: str, model: str, state: str = "ready", capacity: int = 4, kv_tokens: int = 0,
         admin_drain: bool = False, adapters: tuple[str, ...] = ()) -> WorkerView:
    info = WorkerInfo(id=worker_id, url="http://x", engine="sim", model=model, capacity=capacity,
                      kv_tokens=kv_tokens, adapters=adapters)
    return WorkerView(info=info, state=state, admin_drain=admin_drain)  # type: ignore[arg-type]


FLEET = [
    view("a1", "a", kv_tokens=1000, adapters=("a-lora",)),
    view("a2", "a", kv_tokens=3000, capacity=8),
    view("a3", "a", admin_drain=True),  # draining: its work is outstanding, its slots are not capacity
    view("a4", "a", state="starting"),
    view("b1", "b"),  # no KV size declared
    view("c1", "c", state="starting"),  # nothing ready
]
REQUESTS = {"a1": 4, "a2": 2, "a3": 3, "b1": 1, "gone": 7}
TOKENS = {"a1": 500, "a2": 1500, "a3": 900, "b1": 40}
QUEUED = {"a": 1, "a-lora": 2, "b": 0, "nobody-serves-this": 5}
BASES = {"a": "", "a-lora": "a", "b": "", "c": ""}


def test_signals_per_model() -> None:
    """One entry per base model: an adapter's queue counts for its base, a draining worker's
    requests count as outstanding but not towards saturation, unknown figures are None."""
    by_model = {s.model: s for s in signals(FLEET, REQUESTS, TOKENS, QUEUED, BASES)}
    assert list(by_model) == ["a", "b", "c"]
    a = by_model["a"]
    assert (a.ready, a.starting, a.draining, a.capacity) == (2, 1, 1, 12)
    assert (a.outstanding, a.queue_depth) == (9, 3)
    assert a.saturation == pytest.approx(6 / 12)
    assert a.kv_use_ratio == pytest.approx(2000 / 4000)
    assert [w.id for w in a.workers] == ["a1", "a2", "a3", "a4"]
    b = by_model["b"]
    assert (b.outstanding, b.queue_depth, b.saturation, b.kv_use_ratio) == (1, 0, 0.25, None)
    c = by_model["c"]
    assert (c.ready, c.starting, c.saturation, c.kv_use_ratio) == (0, 1, None, None)


def test_collector_exposes_only_known_figures() -> None:
    """The four gauges, one series per served model, and no NaN: a ratio that is unknown
    is absent, not 0 and not NaN."""
    registry = CollectorRegistry()
    registry.register(ScalingCollector(lambda: signals(FLEET, REQUESTS, TOKENS, QUEUED, BASES)))
    series = {(s.name, s.labels["model"]): s.value
              for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    assert series[(OUTSTANDING, "a")] == 9 and series[(QUEUE_DEPTH, "a")] == 3
    assert series[(SATURATION, "a")] == 0.5 and series[(KV_USE_RATIO, "a")] == 0.5
    assert series[(SATURATION, "b")] == 0.25 and (KV_USE_RATIO, "b") not in series
    assert (SATURATION, "c") not in series and series[(OUTSTANDING, "c")] == 0
    assert {model for _, model in series} == {"a", "b", "c"}
    assert not any(math.isnan(v) for v in series.values())


def _scrape(url: str) -> dict[tuple[str, str], float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(s.name, s.labels.get("model", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("fleetgate_model_")}


def test_live_gateway_under_load(fleet_factory: Callable[[], Fleet]) -> None:
    """Eight long requests on one 2-slot worker: the gateway sends 4 (twice its slots, where it
    starts queueing) and queues 4; /metrics and /admin/scaling say so, and go back to 0."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--set", "queue_timeout_s=60")
    fleet.worker("w", "--model", "live", "--option", "max_num_seqs=2", "--option", "time_scale=1.0")
    fleet.wait_ready(url, "w")
    assert httpx.get(url + "/admin/scaling").status_code == 401
    statuses: list[int] = []

    def one() -> None:
        body = {"model": "live", "prompt": "tell me a long story", "max_tokens": 80, "ignore_eos": True}
        statuses.append(httpx.post(url + "/v1/completions", json=body, timeout=120).status_code)

    httpx.post(url + "/v1/completions", json={"model": "no-such-model", "prompt": "x"})
    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    with fleet.admin(url) as admin:
        def loaded() -> ModelSignal | None:
            s = next(m for m in admin.get("/admin/scaling").json()["data"] if m["model"] == "live")
            return s if (s["outstanding"], s["queue_depth"]) == (4, 4) else None

        s = wait_until(loaded, timeout=20, interval=0.1)
        scrape = _scrape(url)
        for t in threads:
            t.join(120)
        idle = next(m for m in admin.get("/admin/scaling").json()["data"] if m["model"] == "live")
    assert s["saturation"] == 2.0 and s["capacity"] == 2 and s["ready"] == 1  # type: ignore[index]
    assert 0 < s["kv_use_ratio"] < 1  # type: ignore[index]
    assert scrape[(OUTSTANDING, "live")] >= 1 and (SATURATION, "live") in scrape and (KV_USE_RATIO, "live") in scrape
    assert {model for _, model in scrape} == {"live"}, "an unknown model makes no series"
    assert statuses == [200] * 8
    assert (idle["outstanding"], idle["queue_depth"], idle["saturation"], idle["kv_use_ratio"]) == (0, 0, 0.0, 0.0)


async def test_queue_depth_counts_requests_waiting_for_room_not_those_held_for_kv() -> None:
    """`Admission.depths` (the queue_depth source) counts each model's line; a request held
    for one worker's KV room (never refused, at most hold_max_s) is not queued."""
    admission = Admission(lambda: 100)
    until = time.monotonic() + 5
    tasks = [
        asyncio.create_task(admission.wait("a", lambda: "slots", until, retry_after=1)),
        asyncio.create_task(admission.wait("a", lambda: "slots", until, retry_after=1)),
        asyncio.create_task(admission.wait("a-lora", lambda: "slots", until, retry_after=1)),
        asyncio.create_task(admission.hold("w1", lambda: False, until)),
    ]
    await asyncio.sleep(0.05)
    try:
        assert admission.depths() == {"a": 2, "a-lora": 1}
        assert signals(FLEET, {}, {}, admission.depths(), BASES)[0].queue_depth == 3
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert admission.depths() == {}
