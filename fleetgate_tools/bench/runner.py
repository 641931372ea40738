"""One benchmark invocation: for each workload, one gateway per policy over the same fleet,
the same requests (same seed) through each in turn, engines reset in between.

A gateway is started afresh for every run, so that no policy carries state (learned
placement, session maps, in-flight counts shared through Redis) into another's run; the
workers stay up, and `POST /sim/reset` empties their prefix caches and LoRA slots before
every run, which then waits until the gateway sees no request in flight anywhere.

A client-side strategy (fleetgate_tools/bench/strategies.py) gets a fresh gateway too, but only
to read the engines' URLs from its /admin/workers: its requests go to the engines
directly. A policy may carry routing options (`fleet+kv_events=false`,
fleetgate_tools/bench/variants.py): its gateway starts with them. With `rounds` > 1 the
policies run again, their order rotated each round.

A conversation workload (`multiturn`, fleetgate_tools/bench/conversations.py) is planned as
conversations instead of requests and played turn by turn (each turn waits for the answer
before it); `--rate` is then conversations a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from fleetgate_tools.bench import engines, variants
from fleetgate_tools.bench.arrivals import arrivals
from fleetgate_tools.bench.cluster import Cluster, StartupError
from fleetgate_tools.bench.conversations import (
    CONVERSATION_WORKLOADS,
    Conversation,
    conversation_stats,
    conversations,
    plan_conversations,
    run_conversations,
    sample_turns,
)
from fleetgate_tools.bench.fleet import FleetSpec, capacity
from fleetgate_tools.bench.floor import Host, adapter_load_floor
from fleetgate_tools.bench.loadgen import POOL, run_requests
from fleetgate_tools.bench.lora import lora_stats
from fleetgate_tools.bench.progress import Progress
from fleetgate_tools.bench.report import AFFINITY, ratios, round_robin_baseline, summarise
from fleetgate_tools.bench.search import find_capacity
from fleetgate_tools.bench.strategies import CLIENT_STRATEGIES, make_route
from fleetgate_tools.bench.workloads import (
    BYTES_PER_TOKEN,
    DEFAULT_WORKLOADS,
    BenchRequest,
    build,
    contents,
    read_trace,
    write_trace,
)

# What one run plays: requests at their times, or conversations turn by turn.
Work = Sequence[BenchRequest] | Sequence[Conversation]

# The policy of the gateway a client-side strategy reads the engines' URLs from.
DISCOVERY_POLICY = "round_robin"


@dataclass(kw_only=True)
class BenchOptions:
    workloads: list[str] = field(default_factory=lambda: list(DEFAULT_WORKLOADS))
    policies: list[str] = field(default_factory=lambda: ["round_robin", "least_outstanding"])
    load: float = 0.8
    rate: float | None = None  # requests/s; overrides load x capacity
    duration_s: float = 8.0
    drain_s: float = 6.0
    settle_s: float = 0.5
    seed: int = 0
    pool: int = POOL
    trace: Path | None = None
    dump_trace: Path | None = None
    api_key: str | None = None
    rounds: int = 1
    sample_s: float = 0.5  # how often the engines' gauges are read during a run


def known_policies(requested: Sequence[str]) -> tuple[list[str], list[str]]:
    """(policies the gateway has or client-side strategies, the unknown ones) — the
    gateway's list is read at run time, so policies added to `gateway.routing.POLICIES`
    are picked up without a bench change."""
    from gateway.routing import POLICIES

    def ok(p: str) -> bool:
        if p in POLICIES or p in CLIENT_STRATEGIES:
            return True
        try:
            return "+" in p and variants.parse(p).policy in POLICIES
        except ValueError:
            return False

    return [p for p in requested if ok(p)], [p for p in requested if not ok(p)]


def rotated(policies: Sequence[str], round_no: int) -> list[str]:
    """The policies in round `round_no` (1-based): shifted by one place each round."""
    k = (round_no - 1) % len(policies) if policies else 0
    return [*policies[k:], *policies[:k]]


def plan(spec: FleetSpec, workload: str, opts: BenchOptions) -> dict[str, Any]:
    """The requests of one workload, and the capacity and rate they were drawn at."""
    if workload == "trace":
        assert opts.trace is not None
        reqs = read_trace(opts.trace)
        span = max((r.at for r in reqs), default=0.0)
        return {"requests": reqs, "capacity_rps": None, "rate_rps": len(reqs) / span if span else None,
                "lora_floor": lora_floor(spec, reqs)}
    params = spec.workloads.get(workload)
    if workload in CONVERSATION_WORKLOADS:
        return plan_multiturn(spec, workload, opts, params or {})
    drafts = contents(workload, opts.seed, spec.facts, params)
    sample = list(itertools.islice(drafts, 300))
    cap = capacity(spec, sample)
    rate = opts.rate if opts.rate else opts.load * cap
    times = arrivals(workload, rate, opts.duration_s, opts.seed, params)
    reqs = build(itertools.chain(sample, drafts), times)
    estimate = sum(r.prompt_tokens() for r in reqs) / len(reqs) if reqs else None
    return {"requests": reqs, "capacity_rps": round(cap, 3), "rate_rps": round(rate, 3),
            "lora_floor": lora_floor(spec, reqs),
            "prompt_tokens_estimate": None if estimate is None else round(estimate, 1)}


def plan_multiturn(spec: FleetSpec, workload: str, opts: BenchOptions, params: dict[str, Any]) -> dict[str, Any]:
    """A conversation workload: conversations at opts.rate a second (else opts.load x the
    fleet's cache-blind capacity in turns a second, over the mean turns a conversation)."""
    sample = list(itertools.islice(conversations(workload, opts.seed, spec.facts, params), 60))
    turns = sample_turns(sample, lambda n: "x" * (n * BYTES_PER_TOKEN))
    cap = capacity(spec, turns) / (len(turns) / len(sample)) if spec.workers else 0.0
    rate = opts.rate if opts.rate else opts.load * cap
    convs = plan_conversations(conversations(workload, opts.seed, spec.facts, params), rate, opts.duration_s, opts.seed)
    first = [BenchRequest(id=0, at=0, model=c.model, messages=[{"role": "system", "content": c.system},
             {"role": "user", "content": c.first_user()}], max_tokens=1).prompt_tokens() for c in convs]  # fmt: skip
    return {"requests": convs, "capacity_rps": round(cap, 3) if cap else None, "rate_rps": round(rate, 3),
            "unit": "conversations", "turns": sum(len(c.turns) for c in convs),
            "planned_end_s": round(max((c.at + c.span_s() for c in convs), default=0.0), 1),
            "prompt_tokens_estimate": round(sum(first) / len(first), 1) if first else None}  # fmt: skip


def lora_floor(spec: FleetSpec, requests: Work) -> int | None:
    """The fewest adapter loads any routing could do for these requests on this fleet
    (fleetgate_tools/bench/floor.py); None when no request names an adapter."""
    names = [r.model for r in requests if isinstance(r, BenchRequest) and r.model in spec.adapters]
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
    requests: Work,
    opts: BenchOptions,
    progress: Progress | None,
    admin_token: str | None = None,
    policy: str | None = None,
) -> tuple[list[Any], float, dict[str, dict[str, float]], list[str], dict[str, Any]]:
    """One run through `gateway`, or, for a client-side `policy`, straight to `workers`:
    outcomes, wall time, engine counter deltas, engines not reset, and the engines' own
    load during the run (engines.load_stats), with a conversation workload's figures
    (conversations.conversation_stats)."""
    target: Any = gateway
    if policy in CLIENT_STRATEGIES:
        target = make_route(policy, workers)
    async with httpx.AsyncClient(timeout=10) as client:
        not_reset = await engines.reset(client, workers)
        await asyncio.sleep(opts.settle_s)
        if admin_token:
            await engines.wait_idle(client, gateway, admin_token)
        before = await engines.scrape(client, workers)
        on_progress = (lambda s, d, t: progress.update(s, d, t)) if progress else None
        extra: dict[str, Any] = {}
        async with engines.LoadSampler(client, workers, opts.sample_s) as sampler:
            if requests and isinstance(requests[0], Conversation):
                convs = [c for c in requests if isinstance(c, Conversation)]
                outcomes, wall, log = await run_conversations(
                    target, convs, pool=opts.pool, drain_s=opts.drain_s, api_key=opts.api_key,
                    on_progress=on_progress,
                )  # fmt: skip
                window: float | None = max(c.at + c.span_s() for c in convs)
                extra = conversation_stats(outcomes, log, len(convs), window, sum(w.kv_tokens for w in workers))
            else:
                reqs = [r for r in requests if isinstance(r, BenchRequest)]
                outcomes, wall = await run_requests(
                    target, reqs, pool=opts.pool, drain_s=opts.drain_s, api_key=opts.api_key,
                    on_progress=on_progress,
                )  # fmt: skip
                window = max((r.at for r in reqs), default=None)
        after = await engines.scrape(client, workers)
        if admin_token:
            # Which engines' KV cache events the gateway had an index of at the end (what a
            # policy routing on them could use): "2/2".
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                listed = await engines.list_workers(client, gateway, admin_token)
                extra["kv_events_workers"] = f"{sum(w.kv_events == 'events' for w in listed)}/{len(listed)}"
    load = engines.load_stats(sampler.samples, window) | lora_stats(sampler.lora_samples) | extra
    if waited := sum(o.pool_full for o in outcomes):
        load["client_pool_full"] = waited
        if progress:
            progress.note(f"warning: {waited} of {len(outcomes)} requests waited for one of the client's "
                          f"{opts.pool} connections (--pool): their latency includes that wait")
    return outcomes, wall, engines.deltas(before, after), not_reset, load


def _plan_once(spec: FleetSpec, workload: str, opts: BenchOptions, plans: dict[str, Any],
               many: bool) -> Work:  # fmt: skip
    """Plan a workload, note its plan (without the requests) and dump its trace if asked."""
    planned = plan(spec, workload, opts)
    plans[workload] = {k: v for k, v in planned.items() if k != "requests"} | {
        "requests": len(planned["requests"])
    }
    if opts.dump_trace:
        write_trace(dump_path(opts.dump_trace, workload, many), planned["requests"])
    return planned["requests"]  # type: ignore[no-any-return]


def run_fleet(spec: FleetSpec, cluster: Cluster, opts: BenchOptions, progress: Progress) -> dict[str, Any]:
    policies, unknown = known_policies(opts.policies)
    for p in unknown:
        warnings.warn(f"routing policy {p!r} is not in gateway.routing.POLICIES: skipped", stacklevel=2)
        progress.note(f"warning: policy {p!r} is unknown to this gateway: skipped")
    if not policies:
        raise SystemExit("no known routing policy to run")
    workloads = ["trace"] if opts.trace else opts.workloads
    rounds = max(1, opts.rounds)
    progress.runs = len(workloads) * len(policies) * rounds
    runs: list[dict[str, Any]] = []
    plans: dict[str, Any] = {}
    failed: list[dict[str, str]] = []
    for wl in workloads:
        requests = _plan_once(spec, wl, opts, plans, many=len(workloads) > 1)
        for rnd in range(1, rounds + 1):
            for policy in rotated(policies, rnd):
                label = f"{wl}/{policy}" + (f" r{rnd}" if rounds > 1 else "")
                progress.start_run(label, len(requests))
                try:
                    run = _run_one(cluster, wl, policy, requests, opts, progress)
                except StartupError as exc:
                    # One policy's gateway refusing its settings (e.g. a routing option of a
                    # change not in yet) leaves the other policies' runs standing.
                    reason = _refusal(str(exc))
                    progress.note(f"{label}: its gateway did not start: {reason}")
                    failed.append({"run": label, "reason": reason})
                    continue
                runs.append(run | ({"round": rnd} if rounds > 1 else {}))
    if not runs and failed:
        raise SystemExit(f"no run: {failed[0]['run']}: {failed[0]['reason']}")
    return {"runs": runs, "plans": plans, "skipped_policies": unknown, "failed_runs": failed}


def _refusal(text: str) -> str:
    """The line of a process's log tail that says why it stopped (argparse's `error:`), else the first."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[0] if lines else "")


def _run_one(cluster: Cluster, wl: str, policy: str, requests: Work,
             opts: BenchOptions, progress: Progress | None) -> dict[str, Any]:  # fmt: skip
    # A fresh gateway per run: no policy inherits another's state, and in-flight counts
    # shared through Redis (leased per gateway) cannot leak between runs.
    client_side = policy in CLIENT_STRATEGIES
    gateways = cluster.start_gateways([DISCOVERY_POLICY if client_side else policy])
    try:
        gw = gateways[0]
        workers = asyncio.run(_workers(gw.url, cluster.admin_token))
        outcomes, wall, deltas, not_reset, load = asyncio.run(
            measure(gw.url, workers, requests, opts, progress, cluster.admin_token, policy)
        )
        if gw.routing_ignored:
            load["routing_ignored"] = gw.routing_ignored
        return summarise(wl, policy, outcomes, wall, deltas, not_reset=not_reset,
                         all_workers=[w.id for w in workers], **load)  # fmt: skip
    finally:
        cluster.stop_gateways(gateways)


def attached_policies(requested: Sequence[str]) -> list[str]:
    """What an attached run measures: every client-side strategy asked for (sent to the
    engines the gateway lists), then the gateway itself ("attached") if any other name was
    asked for: its policy is whatever it was started with."""
    client = [p for p in requested if p in CLIENT_STRATEGIES]
    return client + (["attached"] if len(client) < len(requested) or not requested else [])


def run_attached(url: str, admin_token: str | None, spec: FleetSpec, opts: BenchOptions,
                 progress: Progress) -> dict[str, Any]:  # fmt: skip
    """Against a running gateway: its one policy, and the client-side strategies named in
    opts.policies; engines read (and reset) when the admin token is given (the client-side
    strategies need it to find the engines)."""
    workloads = ["trace"] if opts.trace else opts.workloads
    policies = attached_policies(opts.policies)
    if not admin_token and any(p in CLIENT_STRATEGIES for p in policies):
        raise SystemExit("client-side strategies need --admin-token (to read /admin/workers)")
    progress.runs = len(workloads) * len(policies)
    runs: list[dict[str, Any]] = []
    plans: dict[str, Any] = {}
    workers = asyncio.run(_workers(url, admin_token)) if admin_token else []
    for wl in workloads:
        requests = _plan_once(spec, wl, opts, plans, many=len(workloads) > 1)
        for name in policies:
            progress.start_run(f"{wl}/{name}", len(requests))
            outcomes, wall, deltas, not_reset, load = asyncio.run(
                measure(url, workers, requests, opts, progress, admin_token, name)
            )
            policy = name
            if name == "attached":
                policy = next((o.route.split(":")[0] for o in outcomes if o.route), "attached")
                # One policy with routing options asked for: the gateway was started with
                # them (scripts/gpu_bench_multiturn.sh): its row carries the whole name.
                asked = [p for p in opts.policies if p not in CLIENT_STRATEGIES]
                if len(asked) == 1 and "+" in asked[0] and variants.parse(asked[0]).policy == policy:
                    policy = asked[0]
            runs.append(summarise(wl, policy, outcomes, wall, deltas, not_reset=not_reset,
                                  all_workers=[w.id for w in workers], **load))  # fmt: skip
    return {"runs": runs, "plans": plans, "skipped_policies": []}


def run_capacity(
    spec: FleetSpec,
    opts: BenchOptions,
    progress: Progress,
    *,
    target_p50: float,
    start: float,
    cluster: Cluster | None = None,
    attach: str | None = None,
    admin_token: str | None = None,
    strategy: str = AFFINITY,
) -> dict[str, Any]:
    """The capacity search (fleetgate_tools/bench/search.py) for a client-side strategy on the
    first workload of opts: each step plans the workload at its rate and measures it. The
    engines are found through a gateway started on `cluster`, or the one at `attach`."""
    if strategy not in CLIENT_STRATEGIES:
        raise SystemExit(f"the capacity search runs a client-side strategy ({', '.join(CLIENT_STRATEGIES)})")
    wl = opts.workloads[0]
    gateways = cluster.start_gateways([DISCOVERY_POLICY]) if cluster else []
    url = gateways[0].url if gateways else attach
    token = cluster.admin_token if cluster else admin_token
    if not url or not token:
        raise SystemExit("the capacity search needs a fleet, or --attach with --admin-token")
    runs: list[dict[str, Any]] = []
    try:
        workers = asyncio.run(_workers(url, token))

        def one(rate: float) -> dict[str, Any]:
            at = replace(opts, rate=rate)
            requests = plan(spec, wl, at)["requests"]
            progress.runs = progress.index + 1  # open-ended: one step at a time
            progress.start_run(f"capacity {wl}/{strategy} at {rate:g}/s", len(requests))
            outcomes, wall, deltas, not_reset, load = asyncio.run(
                measure(url, workers, requests, at, progress, token, strategy)
            )
            run = summarise(wl, strategy, outcomes, wall, deltas, not_reset=not_reset,
                            all_workers=[w.id for w in workers], rate=rate, **load)  # fmt: skip
            runs.append(run)
            return run

        rate, steps = find_capacity(one, start=start, target_p50=target_p50, note=progress.note)
    finally:
        if cluster:
            cluster.stop_gateways(gateways)
    return {"capacity_rps": rate, "target_ttft_p50": target_p50, "strategy": strategy,
            "workload": wl, "steps": [s._asdict() for s in steps], "runs": runs}  # fmt: skip


async def _workers(gateway: str, admin_token: str | None) -> list[engines.WorkerRef]:
    async with httpx.AsyncClient(timeout=10) as client:
        return await engines.list_workers(client, gateway, admin_token or "")


def finish(result: dict[str, Any], started: float) -> dict[str, Any]:
    runs = result["runs"]
    result["baseline"] = round_robin_baseline(runs)
    result["ratios"] = ratios(runs, result["baseline"])
    if any(r["policy"] == AFFINITY for r in runs):
        result["ratios_affinity"] = ratios(runs, AFFINITY)
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result
