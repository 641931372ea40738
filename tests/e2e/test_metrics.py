"""Prometheus metrics: the recording API in-process, then a scrape of a live gateway."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetgate.schema import GpuInfo, Load, WorkerInfo, WorkerView
from gateway.fleet import FleetSnapshot
from gateway.observe.metrics import DecisionLog, GatewayMetrics, usage_of
from tests.conftest import Fleet

ROOT = Path(__file__).resolve().parents[2]
MODEL = "metrics-model"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a scrape by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(scrape: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    return scrape[(name, frozenset(labels.items()))]


def view(worker_id: str, state: str = "ready", **load: Any) -> WorkerView:
    info = WorkerInfo(id=worker_id, url="http://x", engine="sim", model=MODEL, host="h1",
                      gpu=GpuInfo(name="NVIDIA H100", memory_mib=81920))
    return WorkerView(info=info, state=state, load=Load(**load), last_heartbeat=time.time())  # type: ignore[arg-type]


def fed_metrics() -> GatewayMetrics:
    """A GatewayMetrics with every method called and a fake two-worker fleet attached."""
    metrics = GatewayMetrics()
    watcher = SimpleNamespace(
        snapshot=FleetSnapshot.build([view("w1", running=3, waiting=1, kv_cache_usage=0.5),
                                      view("w2", "draining")], 1),
        degraded=False, age_s=0.25,
    )
    metrics.watch_fleet(watcher, {"w1": 4})  # type: ignore[arg-type]
    metrics.request_done(MODEL, "w1", 200, True, 1.5, 0.04, prompt_tokens=10, completion_tokens=7)
    metrics.request_done(MODEL, "w1", 200, False, 0.3, None, prompt_tokens=5, completion_tokens=2)
    metrics.request_done(MODEL, "", 503, False, 0.001)
    metrics.retry(MODEL)
    metrics.failover(MODEL)
    metrics.resumed_stream(MODEL)
    metrics.shed(MODEL, 503, "no_worker_available")
    return metrics


def test_recording_api_produces_conventional_series() -> None:
    """Each recording call lands in a conventionally named series, fleet gauges come from the snapshot."""
    scrape = samples(fed_metrics().exposition().decode())
    assert value(scrape, "fleetgate_requests_total", model=MODEL, worker="w1", status="200") == 2
    assert value(scrape, "fleetgate_requests_total", model=MODEL, worker="none", status="503") == 1
    assert value(scrape, "fleetgate_request_duration_seconds_count", model=MODEL, stream="true") == 1
    assert value(scrape, "fleetgate_request_duration_seconds_sum", model=MODEL, stream="false") == pytest.approx(0.301)
    assert value(scrape, "fleetgate_time_to_first_token_seconds_bucket", model=MODEL, le="0.05") == 1
    assert value(scrape, "fleetgate_time_to_first_token_seconds_count", model=MODEL) == 1
    assert value(scrape, "fleetgate_tokens_total", model=MODEL, kind="prompt") == 15
    assert value(scrape, "fleetgate_tokens_total", model=MODEL, kind="completion") == 9
    for name in ("retries", "failovers", "resumed_streams"):
        assert value(scrape, f"fleetgate_{name}_total", model=MODEL) == 1
    assert value(scrape, "fleetgate_shed_total", model=MODEL, status="503", reason="no_worker_available") == 1
    assert value(scrape, "fleetgate_workers", state="ready") == 1
    assert value(scrape, "fleetgate_workers", state="draining") == 1
    assert value(scrape, "fleetgate_workers", state="starting") == 0
    assert value(scrape, "fleetgate_worker_inflight", worker="w1") == 4
    assert value(scrape, "fleetgate_worker_running", worker="w1") == 3
    assert value(scrape, "fleetgate_worker_waiting", worker="w1") == 1
    assert value(scrape, "fleetgate_worker_kv_cache_usage", worker="w1") == 0.5
    assert value(scrape, "fleetgate_worker_info", worker="w2", engine="sim", model=MODEL, host="h1",
                 gpu="NVIDIA H100") == 1
    assert value(scrape, "fleetgate_registry_up") == 1


def test_request_done_is_cheap() -> None:
    """The per-request call costs microseconds, far inside the gateway's ~0.5 ms CPU budget."""
    metrics = GatewayMetrics()
    n = 3000
    # CPU time, the budget's unit: wall time also counts what other processes ran meanwhile.
    start = time.thread_time()
    for i in range(n):
        metrics.request_done(MODEL, f"w{i % 4}", 200, True, 0.5, 0.05, 100, 20)
        metrics.record_decision("req", MODEL, f"w{i % 4}", "fleet:affinity", 1, 200)
    per_call = (time.thread_time() - start) / n
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} µs per request"


def test_decision_log_keeps_the_newest_hundred() -> None:
    """The decision ring buffer is bounded and lists the newest decision first."""
    log = DecisionLog(100)
    for i in range(250):
        log.record(f"r{i}", MODEL, "w1", "fleet:least_load", 1, 200)
    rows = log.as_json()
    assert len(rows) == 100 and log.total == 250
    assert rows[0]["request_id"] == "r249" and rows[-1]["request_id"] == "r150"
    assert set(rows[0]) == {"ts", "request_id", "model", "worker", "reason", "attempts", "status"}


def test_usage_of_reads_bodies_and_stream_events() -> None:
    """Token usage comes out of a whole response or a final SSE event, and is (0, 0) when absent."""
    body = b'{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}'
    assert usage_of(body) == (12, 3)
    assert usage_of(b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}') == (5, 9)
    assert usage_of(b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}') == (0, 0)
    assert usage_of(b'data: {"choices":[{"delta":{"content":"x"}}]}') == (0, 0)
    assert usage_of(b"data: [DONE]") == (0, 0) and usage_of(b'{"usage": broken') == (0, 0)


def test_grafana_dashboard_uses_only_exposed_metrics() -> None:
    """Every metric the Grafana dashboard queries is one the gateway exposes."""
    exposed = {name for name, _ in samples(fed_metrics().exposition().decode())}
    dashboard = json.loads((ROOT / "config" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) > 15
    used = {m for e in exprs for m in re.findall(r"\bfleetgate_[a-z_]+", e)}
    assert used - exposed == set()
    assert {"fleetgate_worker_kv_cache_usage", "fleetgate_time_to_first_token_seconds_bucket"} <= used


# -- a live gateway ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("metrics"))
    try:
        _, url = fleet.gateway()
        for wid, profile in (("m-big", "h100-7b"), ("m-small", "t4-7b")):
            fleet.worker(wid, "--model", MODEL, "--option", "time_scale=0.05", "--sim-profile", profile)
        fleet.wait_ready(url, "m-big", "m-small")
        yield fleet, url
    finally:
        fleet.close()


def test_scrape_of_a_live_gateway(live: tuple[Fleet, str]) -> None:
    """/metrics on a running gateway parses as Prometheus text and shows the two-worker fleet."""
    _, url = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for stream in (False, True, False):
        assert httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=30).status_code == 200
    resp = httpx.get(f"{url}/metrics", timeout=5)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    scrape = samples(resp.text)
    assert value(scrape, "fleetgate_workers", state="ready") == 2
    assert value(scrape, "fleetgate_registry_up") == 1
    for wid in ("m-big", "m-small"):
        for gauge in ("inflight", "running", "waiting", "kv_cache_usage"):
            assert (f"fleetgate_worker_{gauge}", frozenset({("worker", wid)})) in scrape


def test_live_requests_are_counted(live: tuple[Fleet, str]) -> None:
    """Requests through a live gateway show up in the request, latency and TTFT series."""
    _, url = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}], "max_tokens": 4}
    before = samples(httpx.get(f"{url}/metrics", timeout=5).text)
    for stream in (False, True):
        assert httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": stream}, timeout=30).status_code == 200
    after = samples(httpx.get(f"{url}/metrics", timeout=5).text)

    def total(scrape: dict[Any, float], name: str, **want: str) -> float:
        return sum(v for (n, labels), v in scrape.items()
                   if n == name and set(want.items()) <= set(labels))

    assert total(after, "fleetgate_requests_total", model=MODEL, status="200") - total(
        before, "fleetgate_requests_total", model=MODEL, status="200") == 2
    assert total(after, "fleetgate_time_to_first_token_seconds_count", model=MODEL) > total(
        before, "fleetgate_time_to_first_token_seconds_count", model=MODEL)
    decisions = httpx.get(f"{url}/admin/decisions", timeout=5,
                          headers={"authorization": "Bearer test-admin-token"}).json()["data"]
    assert decisions and decisions[0]["model"] == MODEL


def test_openapi_schema_is_served(live: tuple[Fleet, str]) -> None:
    """The OpenAPI schema is at Litestar's default /schema/openapi.json and names the OpenAI routes."""
    _, url = live
    resp = httpx.get(f"{url}/schema/openapi.json", timeout=10)
    assert resp.status_code == 200
    paths = resp.json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(paths)
    assert "/admin/ui" not in paths and "/metrics" not in paths
