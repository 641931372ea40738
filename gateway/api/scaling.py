"""The scaling signal: per served model, the work the fleet carries against what it can carry.

From the gateway's own live account (the in-flight hash every replica shares, the KV
tokens those requests hold, the admission queue) and the snapshot's declared sizes
(each worker's sequence slots and KV tokens), never from a second-old engine gauge:

    outstanding   requests in flight to the model's workers, summed over every gateway
    queue_depth   requests waiting in this gateway's admission queue for the model
    saturation    in flight on its ready workers / their sequence slots (1.0: every slot
                  busy; up to 1 + shed_queue_ratio, where the gateway starts to queue)
    kv_use_ratio  KV tokens the account holds on its ready workers / their KV tokens
                  (absent while no ready worker declared its KV size)

One series per base model that a registered worker serves (an adapter's queue counts
for its base model: its workers are the ones to add), so labels are bounded by the
fleet. Computed when read (a Prometheus scrape, `GET /admin/scaling`), never on the
request path. `fleetgate autoscale` and KEDA/HPA read these.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import msgspec
from litestar import Request, Response, get
from litestar.datastructures import State
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleetgate.schema import WorkerView
from gateway.api.openapi import admin

if TYPE_CHECKING:
    from gateway.accounts.admission import Admission
    from gateway.accounts.inflight import SharedInflight
    from gateway.fleet import FleetWatcher
    from gateway.state import Gateway

# Metric names: the Helm chart's KEDA/HPA example and docs/autoscaling.md name these.
OUTSTANDING = "fleetgate_model_outstanding_requests"
QUEUE_DEPTH = "fleetgate_model_queue_depth"
KV_USE_RATIO = "fleetgate_model_kv_use_ratio"
SATURATION = "fleetgate_model_saturation"


class WorkerLoad(msgspec.Struct, kw_only=True, frozen=True):
    """One worker of the model, as the autoscaler needs it (to pick one and drain it)."""

    id: str
    state: str  # effective state: starting, ready, draining, unhealthy
    routable: bool
    inflight: int
    capacity: int
    kv_tokens: int = 0
    kv_used: int = 0


class ModelSignal(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    model: str
    # Workers by what they can take now: routable (ready), starting, draining; the rest
    # (unhealthy, circuit open) are registered but neither.
    ready: int
    starting: int
    draining: int
    capacity: int  # sequence slots of the ready workers
    outstanding: int
    queue_depth: int
    workers: tuple[WorkerLoad, ...] = ()
    # None: no ready worker (saturation) or none with a declared KV size (kv_use_ratio).
    saturation: float | None = None
    kv_use_ratio: float | None = None


def signals(
    workers: Iterable[WorkerView], requests: Mapping[str, int], tokens: Mapping[str, int],
    queued: Mapping[str, int], bases: Mapping[str, str],
) -> list[ModelSignal]:
    """The signal per base model, sorted by name. Pure.

    `requests` / `tokens`: the live account per worker id; `queued`: requests waiting per
    requested name (a base model or an adapter, which `bases` maps to its base model).
    """
    by_model: dict[str, list[WorkerView]] = {}
    for w in workers:
        by_model.setdefault(w.info.model, []).append(w)
    waiting: dict[str, int] = {}
    for name, count in queued.items():
        base = bases.get(name) or name
        if base in by_model:
            waiting[base] = waiting.get(base, 0) + count
    out = []
    for model in sorted(by_model):
        loads = tuple(
            WorkerLoad(id=w.id, state=w.effective_state, routable=w.routable, inflight=requests.get(w.id, 0),
                       capacity=max(w.info.capacity, 1), kv_tokens=w.info.kv_tokens, kv_used=tokens.get(w.id, 0))
            for w in sorted(by_model[model], key=lambda w: w.id)
        )
        ready = [w for w in loads if w.routable]
        capacity = sum(w.capacity for w in ready)
        kv_total = sum(w.kv_tokens for w in ready)
        out.append(ModelSignal(
            model=model, ready=len(ready), starting=sum(1 for w in loads if w.state == "starting"),
            draining=sum(1 for w in loads if w.state == "draining"), capacity=capacity,
            outstanding=sum(w.inflight for w in loads), queue_depth=waiting.get(model, 0), workers=loads,
            saturation=sum(w.inflight for w in ready) / capacity if capacity else None,
            kv_use_ratio=sum(w.kv_used for w in ready if w.kv_tokens) / kv_total if kv_total else None,
        ))
    return out


def current(watcher: FleetWatcher, inflight: SharedInflight, admission: Admission) -> list[ModelSignal]:
    """The signal now, from the gateway's live objects."""
    snapshot = watcher.snapshot
    return signals(snapshot.workers, inflight, inflight.tokens, admission.depths(), snapshot.models)


class ScalingCollector(Collector):
    """The four per-model gauges, computed at each scrape."""

    def __init__(self, read: Callable[[], list[ModelSignal]]) -> None:
        self.read = read

    def describe(self) -> list[Metric]:
        return []  # no collect() at registration: nothing is read yet

    def collect(self) -> Iterator[Metric]:
        families = {
            OUTSTANDING: GaugeMetricFamily(
                OUTSTANDING, "Requests in flight to the model's workers, from every gateway.", labels=["model"]),
            QUEUE_DEPTH: GaugeMetricFamily(
                QUEUE_DEPTH, "Requests waiting in this gateway's admission queue for the model (its "
                "adapters included).", labels=["model"]),
            KV_USE_RATIO: GaugeMetricFamily(
                KV_USE_RATIO, "KV tokens the gateways' requests hold on the model's ready workers over "
                "their KV cache size (absent while unknown).", labels=["model"]),
            SATURATION: GaugeMetricFamily(
                SATURATION, "Requests in flight on the model's ready workers over their sequence slots "
                "(absent while none is ready).", labels=["model"]),
        }
        for s in self.read():
            families[OUTSTANDING].add_metric([s.model], s.outstanding)
            families[QUEUE_DEPTH].add_metric([s.model], s.queue_depth)
            if s.kv_use_ratio is not None:
                families[KV_USE_RATIO].add_metric([s.model], s.kv_use_ratio)
            if s.saturation is not None:
                families[SATURATION].add_metric([s.model], s.saturation)
        yield from families.values()


@get("/admin/scaling", **admin())
async def admin_scaling(request: Request, state: State) -> Response:
    """The scaling signal as JSON, for `fleetgate autoscale` (no Prometheus needed)."""
    gw: Gateway = state["gw"]
    proxy = gw.proxy
    data = current(gw.watcher, proxy.inflight, proxy.admission)
    body = {"data": data, "ts": time.time(), "registry_up": not gw.watcher.degraded}
    return Response(content=msgspec.json.encode(body), media_type="application/json")


__all__ = [
    "KV_USE_RATIO", "OUTSTANDING", "QUEUE_DEPTH", "SATURATION", "ModelSignal", "ScalingCollector",
    "WorkerLoad", "admin_scaling", "current", "signals",
]
