"""One benchmark invocation: for each workload, one gateway per policy over the same fleet,
the same requests (same seed) through each in turn, engines reset in between.

A gateway is started afresh for every run, so that no policy carries state (learned
placement, session maps, in-flight counts shared through Redis) into another's run; the
workers stay up, and `POST /sim/reset` empties their prefix caches and LoRA slots before
every run, which then waits until the gateway sees no request in flight anywhere.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fleetgate.bench import engines
from fleetgate.bench.cluster import Cluster
from fleetgate.bench.fleet import FleetSpec, capacity
from fleetgate.bench.floor import Host, adapter_load_floor
from fleetgate.bench.loadgen import run_requests
from fleetgate.bench.progress import Progress
from fleetgate.bench.report import ratios, summarise
from fleetgate.bench.workloads import (
    WORKLOADS,
    BenchRequest,
    build,
    bursty_arrivals,
    contents,
    read_trace,
    write_trace,
)


@dataclass(kw_only=True)
class BenchOptions:
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    policies: list[str] = field(default_factory=lambda: ["round_robin", "least_outstanding"])
    load: float = 0.8
    rate: float | None = None  # requests/s; overrides load x capacity
    duration_s: float = 8.0
    drain_s: float = 6.0
    settle_s: float = 0.5
    seed: int = 0
    pool: int = 256
    trace: Path | None = None
    dump_trace: Path | None = None
    api_key: str | None = None


def known_policies(requested: Sequence[str]) -> tuple[list[str], list[str]]:
    """(policies the gateway has, the unknown ones) — the gateway's list is read at run time,
    so policies added to `gateway.routing.POLICIES` are picked up without a bench change."""
    from gateway.routing import POLICIES

    known = [p for p in requested if p in POLICIES]
    return known, [p for p in requested if p not in POLICIES]


def plan(spec: FleetSpec, workload: str, opts: BenchOptions) -> dict[str, Any]:
    """The requests of one workload, and the capacity and rate they were drawn at."""
    if workload == "trace":
        assert opts.trace is not None
        reqs = read_trace(opts.trace)
        span = max((r.at for r in reqs), default=0.0)
        return {"requests": reqs, "capacity_rps": None, "rate_rps": len(reqs) / span if span else None,
                "lora_floor": lora_floor(spec, reqs)}
    drafts = contents(workload, opts.seed, spec.facts, spec.workloads.get(workload))
    sample = list(itertools.islice(drafts, 300))
    cap = capacity(spec, sample)
    rate = opts.rate if opts.rate else opts.load * cap
    arrivals = bursty_arrivals(rate, opts.duration_s, opts.seed)
    reqs = build(itertools.chain(sample, drafts), arrivals)
    return {"requests": reqs, "capacity_rps": round(cap, 3), "rate_rps": round(rate, 3),
            "lora_floor": lora_floor(spec, reqs)}


def lora_floor(spec: FleetSpec, requests: Sequence[BenchRequest]) -> int | None:
    """The fewest adapter loads any routing could do for these requests on this fleet
    (fleetgate/bench/floor.py); None when no request names an adapter."""
    names = [r.model for r in requests if r.model in spec.adapters]
    if not names:
        return None
    hosts = [Host(w.id, frozenset(w.adapters), w.option("max_loras"), pinned=w.flavor == "lmdeploy")
             for w in spec.workers]  # fmt: skip
    return adapter_load_floor(names, hosts)


def dump_path(base: Path, workload: str, many: bool) -> Path:
    if "{workload}" in str(base):
        return Path(str(base).format(workload=workload))
    return base.with_name(f"{base.stem}-{workload}{base.suffix}") if many else base


async def measure(
    gateway: str,
    workers: list[engines.WorkerRef],
    requests: Sequence[BenchRequest],
    opts: BenchOptions,
    progress: Progress | None,
    admin_token: str | None = None,
) -> tuple[list[Any], float, dict[str, dict[str, float]], list[str]]:
    async with httpx.AsyncClient(timeout=10) as client:
        not_reset = await engines.reset(client, workers)
        await asyncio.sleep(opts.settle_s)
        if admin_token:
            await engines.wait_idle(client, gateway, admin_token)
        before = await engines.scrape(client, workers)
        outcomes, wall = await run_requests(
            gateway, requests, pool=opts.pool, drain_s=opts.drain_s, api_key=opts.api_key,
            on_progress=(lambda s, d, t: progress.update(s, d, t)) if progress else None,
        )  # fmt: skip
        after = await engines.scrape(client, workers)
    return outcomes, wall, engines.deltas(before, after), not_reset


def _plan_once(spec: FleetSpec, workload: str, opts: BenchOptions, plans: dict[str, Any],
               many: bool) -> list[BenchRequest]:  # fmt: skip
    """Plan a workload, note its plan (without the requests) and dump its trace if asked."""
    planned = plan(spec, workload, opts)
    plans[workload] = {k: v for k, v in planned.items() if k != "requests"} | {
        "requests": len(planned["requests"])
    }
    if opts.dump_trace:
        write_trace(dump_path(opts.dump_trace, workload, many), planned["requests"])
    return list(planned["requests"])


def run_fleet(spec: FleetSpec, cluster: Cluster, opts: BenchOptions, progress: Progress) -> dict[str, Any]:
    policies, unknown = known_policies(opts.policies)
    for p in unknown:
        warnings.warn(f"routing policy {p!r} is not in gateway.routing.POLICIES: skipped", stacklevel=2)
        progress.note(f"warning: policy {p!r} is unknown to this gateway: skipped")
    if not policies:
        raise SystemExit("no known routing policy to run")
    workloads = ["trace"] if opts.trace else opts.workloads
    progress.runs = len(workloads) * len(policies)
    runs: list[dict[str, Any]] = []
    plans: dict[str, Any] = {}
    for wl in workloads:
        requests = _plan_once(spec, wl, opts, plans, many=len(workloads) > 1)
        for policy in policies:
            # A fresh gateway per run: no policy inherits another's state, and in-flight
            # counts shared through Redis (leased per gateway) cannot leak between runs.
            gateways = cluster.start_gateways([policy])
            try:
                gw = gateways[0]
                workers = asyncio.run(_workers(gw.url, cluster.admin_token))
                progress.start_run(f"{wl}/{policy}", len(requests))
                outcomes, wall, deltas, not_reset = asyncio.run(
                    measure(gw.url, workers, requests, opts, progress, cluster.admin_token)
                )
                runs.append(summarise(wl, policy, outcomes, wall, deltas, not_reset=not_reset,
                                      all_workers=[w.id for w in workers]))  # fmt: skip
            finally:
                cluster.stop_gateways(gateways)
    return {"runs": runs, "plans": plans, "skipped_policies": unknown}


def run_attached(url: str, admin_token: str | None, spec: FleetSpec, opts: BenchOptions,
                 progress: Progress) -> dict[str, Any]:  # fmt: skip
    """Against a running gateway: its one policy, engines read (and reset) when the admin
    token is given."""
    workloads = ["trace"] if opts.trace else opts.workloads
    progress.runs = len(workloads)
    runs: list[dict[str, Any]] = []
    plans: dict[str, Any] = {}
    workers = asyncio.run(_workers(url, admin_token)) if admin_token else []
    for wl in workloads:
        requests = _plan_once(spec, wl, opts, plans, many=len(workloads) > 1)
        progress.start_run(f"{wl}/attached", len(requests))
        outcomes, wall, deltas, not_reset = asyncio.run(
            measure(url, workers, requests, opts, progress, admin_token)
        )
        policy = next((o.route.split(":")[0] for o in outcomes if o.route), "attached")
        runs.append(summarise(wl, policy, outcomes, wall, deltas, not_reset=not_reset,
                              all_workers=[w.id for w in workers]))  # fmt: skip
    return {"runs": runs, "plans": plans, "skipped_policies": []}


async def _workers(gateway: str, admin_token: str | None) -> list[engines.WorkerRef]:
    async with httpx.AsyncClient(timeout=10) as client:
        return await engines.list_workers(client, gateway, admin_token or "")


def finish(result: dict[str, Any], started: float) -> dict[str, Any]:
    result["ratios"] = ratios(result["runs"])
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result
