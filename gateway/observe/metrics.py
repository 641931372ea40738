"""What one gateway exposes about itself: Prometheus metrics and its recent routing decisions.

Two halves with different costs:

- The request path calls `GatewayMetrics.request_done`, `retry`, `failover`,
  `resumed_stream`, `shed` and `record_decision`. Each is a dict lookup of a cached
  label child plus an increment (a few microseconds): the gateway's budget is about
  half a millisecond of CPU per request.
- Fleet gauges (workers by state, per-worker load and in-flight counts) cost the
  request path nothing: `FleetCollector` reads the watcher's snapshot when Prometheus
  scrapes `/metrics`.

Every `GatewayMetrics` has its own `CollectorRegistry`, so two apps in one process
(tests) never share counters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from gateway.engines.upstream import json_object
from gateway.fleet import FleetWatcher
from gateway.observe.cells import CounterFamily as Counter
from gateway.observe.cells import HistogramFamily as Histogram
from gateway.wire import WithUsage

# Seconds. TTFT of a warm engine is tens of milliseconds; a queued one, seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
WORKER_STATES = ("starting", "ready", "draining")
# The `worker` label of a request no worker answered (refused or failed before routing).
NO_WORKER = "none"


_usage_decoder = msgspec.json.Decoder(WithUsage)


def usage_of(payload: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens of an OpenAI response body or one SSE `data:` event.

    (0, 0) when it carries no usage. Only `usage` is decoded; msgspec skips the rest.
    """
    # find(), not `in`: bytes.__contains__ first tries the needle as an int, which raises
    # (and formats) a TypeError each call under CPython 3.11.
    if payload.find(b'"usage"') < 0:
        return 0, 0
    if payload.startswith(b"event:"):  # a named event (the Responses API's): its data line
        payload = payload.partition(b"\ndata:")[2]
    elif payload.startswith(b"data:"):
        payload = payload[5:]
    try:
        decoded = _usage_decoder.decode(payload)
    except msgspec.DecodeError:
        return 0, 0
    return _tokens(decoded)


def answer_usage(body: bytes, valid: Callable[[bytes], bool] = json_object) -> tuple[int, int] | None:
    """The tokens of a whole answer (or a stream's usage event) as `usage_of` reads them, in the
    same pass that checks the body is what `valid` accepts (a 200 must be one JSON object:
    gateway/request/attempts.py); None: it is not. One decode instead of two (issue 33)."""
    try:
        decoded = _usage_decoder.decode(body)
    except msgspec.ValidationError:  # valid JSON of another shape: no usage, if `valid` takes it
        return (0, 0) if valid(body) else None
    except msgspec.DecodeError:
        return None
    return _tokens(decoded)


def _tokens(decoded: WithUsage) -> tuple[int, int]:
    usage = decoded.usage or (decoded.response.usage if decoded.response is not None else None)
    if usage is None:
        return 0, 0
    return usage.prompt_tokens or usage.input_tokens or 0, usage.completion_tokens or usage.output_tokens or 0


class DecisionLog:
    """The last `size` routing decisions of this gateway, newest last; O(1) per record."""

    def __init__(self, size: int = 100) -> None:
        self._ring: deque[tuple[Any, ...]] = deque(maxlen=size)
        self.total = 0

    def record(
        self, request_id: str, model: str, worker: str, reason: str, attempts: int = 1,
        status: int | None = None,
    ) -> None:
        self.total += 1
        self._ring.append((time.time(), request_id, model, worker, reason, attempts, status))

    def as_json(self) -> list[dict[str, Any]]:
        """Newest first, as `GET /admin/decisions` returns them."""
        keys = ("ts", "request_id", "model", "worker", "reason", "attempts", "status")
        return [dict(zip(keys, row, strict=True)) for row in reversed(self._ring)]


class GatewayMetrics:
    def __init__(self, decisions: int = 100) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter(
            "fleetgate_requests", "Requests answered, by requested model (base or adapter), "
            "worker and HTTP status.", ["model", "worker", "status"], registry=r,
        )
        self._duration = Histogram(
            "fleetgate_request_duration_seconds", "Time from the request's arrival to its last "
            "byte, by requested model and whether it streamed.", ["model", "stream"],
            buckets=DURATION_BUCKETS, registry=r,
        )
        self._ttft = Histogram(
            "fleetgate_time_to_first_token_seconds", "Time from a streamed request's arrival to "
            "the first chunk relayed to the client.", ["model"], buckets=TTFT_BUCKETS, registry=r,
        )
        self._tokens = Counter(
            "fleetgate_tokens", "Tokens in answered requests, as the engines reported them "
            "(kind: prompt or completion).", ["model", "kind"], registry=r,
        )
        self._retries = Counter(
            "fleetgate_retries", "Attempts beyond the first (before any byte reached the client).",
            ["model"], registry=r,
        )
        self._failovers = Counter(
            "fleetgate_failovers", "Requests answered by another worker after their first choice "
            "failed.", ["model"], registry=r,
        )
        self._fallbacks = Counter(
            "fleetgate_fallbacks", "Requests sent on to a fallback model (the `fallbacks` setting), by "
            "the model that could not take them, the fallback, and why (no_capacity, no_model, "
            "context_length).", ["model", "fallback", "reason"], registry=r,
        )
        self._resumed = Counter(
            "fleetgate_resumed_streams", "Streams that broke off and were resumed on another worker.",
            ["model"], registry=r,
        )
        self._shed = Counter(
            "fleetgate_shed", "Requests the gateway refused itself because no worker could take "
            "them (status: the HTTP status sent; reason: the limit, queue_full or queue_timeout "
            "for 429, the error code for 503).", ["model", "status", "reason"], registry=r,
        )
        self._errors = Counter(
            "fleetgate_errors", "Requests the gateway answered itself with an error (bad body, bad "
            "key, rate limit, no worker, engines failing), by HTTP status and OpenAI error code.",
            ["status", "code"], registry=r,
        )
        # A requested model as a label value. Models are chosen by clients: the app sets this
        # to keep only names the fleet serves (or served recently), the rest as `unknown`.
        self.model_label: Callable[[str], str] = lambda model: model
        # Answered requests per worker since start; the dashboard turns these into rates.
        self.by_worker: dict[str, int] = {}
        self.started_at = time.time()
        self.decisions = DecisionLog(decisions)

    # -- the request path --------------------------------------------------------------

    def request_done(
        self, model: str, worker: str, status: int, stream: bool, seconds: float,
        ttft_seconds: float | None = None, prompt_tokens: int = 0, completion_tokens: int = 0,
    ) -> None:
        """Once per request, when its last byte went out (or it failed); `worker` may be ''."""
        worker = worker or NO_WORKER
        model = self.model_label(model)
        self._requests.labels(model, worker, str(status)).inc()
        self._duration.labels(model, "true" if stream else "false").observe(seconds)
        if ttft_seconds is not None:
            self._ttft.labels(model).observe(ttft_seconds)
        if prompt_tokens:
            self._tokens.labels(model, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self._tokens.labels(model, "completion").inc(completion_tokens)
        self.by_worker[worker] = self.by_worker.get(worker, 0) + 1

    def retry(self, model: str) -> None:
        self._retries.labels(self.model_label(model)).inc()

    def failover(self, model: str) -> None:
        self._failovers.labels(self.model_label(model)).inc()

    def fallback(self, model: str, fallback: str, reason: str) -> None:
        self._fallbacks.labels(self.model_label(model), self.model_label(fallback), reason).inc()

    def resumed_stream(self, model: str) -> None:
        self._resumed.labels(self.model_label(model)).inc()

    def shed(self, model: str, status: int, reason: str) -> None:
        self._shed.labels(self.model_label(model), str(status), reason).inc()

    def error(self, status: int, code: str | None) -> None:
        """An error the gateway answered itself (its codes are a fixed set)."""
        self._errors.labels(str(status), code or "").inc()

    def record_decision(
        self, request_id: str, model: str, worker: str, reason: str, attempts: int = 1,
        status: int | None = None,
    ) -> None:
        self.decisions.record(request_id, model, worker, reason, attempts, status)

    # -- reading -------------------------------------------------------------------------

    def watch_fleet(self, watcher: FleetWatcher, inflight: Mapping[str, int]) -> None:
        """Expose the fleet gauges, read from `watcher.snapshot` at each scrape."""
        self.registry.register(FleetCollector(watcher, inflight))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def totals(self) -> dict[str, float]:
        """Gateway-wide counts since start, for the dashboard's header."""
        out: dict[str, float] = {}
        for name, metric in (
            ("requests", self._requests), ("retries", self._retries),
            ("failovers", self._failovers), ("resumed_streams", self._resumed), ("shed", self._shed),
            ("errors", self._errors),
        ):
            out[name] = sum(
                s.value for m in metric.collect() for s in m.samples if s.name.endswith("_total")
            )
        return out


class FleetCollector(Collector):
    """Fleet gauges computed from the current snapshot when scraped, never on the request path."""

    def __init__(self, watcher: FleetWatcher, inflight: Mapping[str, int]) -> None:
        self.watcher = watcher
        self.inflight = inflight

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: the watcher may not have read Redis yet

    def collect(self) -> Iterator[Metric]:
        watcher = self.watcher
        snapshot = watcher.snapshot
        by_state = dict.fromkeys(WORKER_STATES, 0)
        workers = GaugeMetricFamily(
            "fleetgate_workers", "Registered workers by state, as this gateway's snapshot sees them.",
            labels=["state"],
        )
        info = GaugeMetricFamily(
            "fleetgate_worker_info", "One series per registered worker, its attributes as labels.",
            labels=["worker", "engine", "model", "host", "gpu"],
        )
        gauges = {
            name: GaugeMetricFamily(f"fleetgate_worker_{name}", text, labels=["worker"])
            for name, text in (
                ("inflight", "Requests in flight to the worker from all gateways."),
                ("running", "Sequences the engine runs, from its last heartbeat."),
                ("waiting", "Sequences queued in the engine, from its last heartbeat."),
                ("kv_cache_usage", "Fraction of the engine's KV cache in use (0-1)."),
            )
        }
        speed = GaugeMetricFamily(
            "fleetgate_worker_speed", "The worker's speed relative to an H100 with a 7B model, as "
            "routing weighs it; `source`: engine (measured from the engine's counters while it "
            "serves) or the start-up figure's (profile, declared, measured, assumed).",
            labels=["worker", "source"],
        )
        for w in snapshot.workers:
            state = w.effective_state
            by_state[state] = by_state.get(state, 0) + 1
            wid = w.id
            gpu = w.info.gpu.name if w.info.gpu else ""
            info.add_metric([wid, w.info.engine, w.info.model, w.info.host, gpu], 1)
            gauges["inflight"].add_metric([wid], self.inflight.get(wid, 0))
            gauges["running"].add_metric([wid], w.load.running)
            gauges["waiting"].add_metric([wid], w.load.waiting)
            gauges["kv_cache_usage"].add_metric([wid], w.load.kv_cache_usage)
            speed.add_metric([wid, w.speed_source], w.speed)
        for state, count in by_state.items():
            workers.add_metric([state], count)
        yield workers
        yield info
        yield from gauges.values()
        yield speed
        yield GaugeMetricFamily(
            "fleetgate_registry_up", "1 while this gateway reads the Redis registry, 0 while it "
            "routes on its last snapshot.", value=0 if watcher.degraded else 1,
        )
        if snapshot.read_at:
            yield GaugeMetricFamily(
                "fleetgate_snapshot_age_seconds", "Age of the fleet snapshot this gateway routes on.",
                value=watcher.age_s,
            )
