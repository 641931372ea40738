#!/usr/bin/env python
"""Compare routing policies on a simulated fleet: same requests, same seed, side by side.

    python scripts/bench_fleet.py                                  # defaults: < 5 min
    python scripts/bench_fleet.py --workloads prefix --policies round_robin,fleet --load 0.9
    python scripts/bench_fleet.py --dump-trace /tmp/t.jsonl        # also write the requests
    python scripts/bench_fleet.py --trace /tmp/t-prefix.jsonl      # replay a trace
    python scripts/bench_fleet.py --attach http://127.0.0.1:8000 --admin-token T
    # issue 14's KV-pressure scenario: client-side strategies beside gateway policies
    python scripts/bench_fleet.py --fleet config/bench/pressure.yaml --workloads pressure,skew \
        --policies tenant_affinity,round_robin,least_outstanding,fleet --rate 32 --rounds 2
    python scripts/bench_fleet.py --fleet config/bench/pressure.yaml --workloads pressure \
        --find-capacity                                       # the capacity rate
    # issue 31: 60 s runs (the gateway's queue timeout is 10 s), max_tokens 4096 with answers
    # of 64 (pressure_long), three engines with 24 tenants (config/bench/pressure3.yaml)
    python scripts/bench_fleet.py --fleet config/bench/pressure.yaml --workloads pressure,skew,pressure_long \
        --policies tenant_affinity,direct_round_robin,fleet --rate 32 --duration 60 --drain 25
    python scripts/bench_fleet.py --fleet config/bench/pressure3.yaml --workloads pressure \
        --policies tenant_affinity,direct_round_robin,fleet --rate 44 --duration 60 --drain 25
    # issue 36: 16 LoRA adapters, Zipf 1.0, two engines of 8 slots (each engine's adapters
    # printed beside every row; scripts/gpu_bench.sh lora-all runs it on vLLM)
    python scripts/bench_fleet.py --fleet config/bench/lora.yaml --workloads lora \
        --policies adapter_affinity,direct_round_robin,fleet --rate 16 --duration 35 --drain 25
    # issue 31: multi-turn conversations (--rate: conversations a second), each turn carrying
    # the engine's previous answer, no session header; the gateway's fleet policy with and
    # without the engines' KV events (a policy name may carry routing options: POLICY+KEY=VALUE)
    python scripts/bench_fleet.py --fleet config/bench/multiturn.yaml --workloads multiturn \
        --policies direct_round_robin,fleet+kv_events=false,fleet+kv_events=true --rate 1 --duration 40 --drain 20

Brings up Redis (FLEETGATE_REDIS_URL, else 127.0.0.1:6379 if it answers, else an embedded
one), the fleet from --fleet as real `python -m workers --engine sim` agents, and for each
workload one gateway per policy; prints the table and ratios against round-robin (and
against the tenant_affinity client when it ran), writes JSON and a PNG (TTFT CDFs and
throughput bars). `tenant_affinity` and `direct_round_robin` are client-side strategies:
they send to the engines directly (fleetgate_tools/bench/strategies.py). Every row has, beside
what the client saw, the engines' own gauges read twice a second during the run (requests
waiting, max; running, mean/max; KV use, mean) and their preemptions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetgate_tools.bench import png  # noqa: E402
from fleetgate_tools.bench.cluster import running  # noqa: E402
from fleetgate_tools.bench.conversations import CONVERSATION_WORKLOADS  # noqa: E402
from fleetgate_tools.bench.fleet import FleetSpec, load_fleet  # noqa: E402
from fleetgate_tools.bench.loadgen import POOL  # noqa: E402
from fleetgate_tools.bench.lora import format_lora  # noqa: E402
from fleetgate_tools.bench.multiturn_tables import format_conversations  # noqa: E402
from fleetgate_tools.bench.progress import Progress  # noqa: E402
from fleetgate_tools.bench.report import AFFINITY, format_ratios, format_routing, format_table  # noqa: E402
from fleetgate_tools.bench.runner import (  # noqa: E402
    BenchOptions,
    finish,
    plan,
    run_attached,
    run_capacity,
    run_fleet,
)
from fleetgate_tools.bench.workloads import DEFAULT_WORKLOADS, WORKLOADS  # noqa: E402

DEFAULT_POLICIES = "round_robin,random,least_outstanding,fleet"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", default=str(ROOT / "config/bench/default.yaml"))
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                   help="comma list of " + ", ".join([*WORKLOADS, *CONVERSATION_WORKLOADS]))
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma list; ones the gateway does not know are skipped with a warning")
    p.add_argument("--load", type=float, default=0.8, help="fraction of the estimated fleet capacity")
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s (overrides --load); conversations/s for a conversation workload")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=6.0, help="seconds to wait for stragglers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1, help="run every policy this often, order rotated")
    p.add_argument("--find-capacity", action="store_true",
                   help="search the highest rate at which tenant_affinity keeps TTFT p50 under "
                   "--capacity-ttft on the first workload (--duration per step), instead of a benchmark")
    p.add_argument("--capacity-ttft", type=float, default=None,
                   help="TTFT p50 target in real seconds (default 0.2 x the fleet's time_scale)")
    p.add_argument("--capacity-start", type=float, default=None,
                   help="first rate tried (default --rate, else the fleet's cache-blind capacity estimate)")
    p.add_argument("--pool", type=int, default=POOL, help="max open connections (a request that waits for one is late: the run warns)")
    p.add_argument("--trace", type=Path, help="replay this JSONL trace instead of the workloads")
    p.add_argument("--dump-trace", type=Path, help="write each workload's requests as JSONL "
                   "(path may contain {workload})")
    p.add_argument("--attach", help="URL of a running gateway: measure it, start nothing")
    p.add_argument("--admin-token", default=os.environ.get("FLEETGATE_ADMIN_TOKEN"),
                   help="--attach: to read the engines' metrics via /admin/workers")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", type=Path, default=ROOT / ".run/bench/results.json")
    p.add_argument("--png", type=Path, default=None, help="default: --out with .png")
    p.add_argument("--run-dir", type=Path, default=None, help="logs (default: .run/bench/<time>)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.monotonic()
    spec = load_fleet(args.fleet)
    opts = BenchOptions(
        workloads=[w for w in args.workloads.split(",") if w],
        policies=[p for p in args.policies.split(",") if p],
        load=args.load, rate=args.rate, duration_s=args.duration, drain_s=args.drain,
        seed=args.seed, pool=args.pool, trace=args.trace, dump_trace=args.dump_trace,
        api_key=args.api_key, rounds=args.rounds,
    )  # fmt: skip
    for w in opts.workloads:
        if w not in WORKLOADS and w not in CONVERSATION_WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {', '.join([*WORKLOADS, *CONVERSATION_WORKLOADS])}")
    progress = Progress(runs=1)
    run_dir = args.run_dir or ROOT / ".run/bench" / time.strftime("%Y%m%d-%H%M%S")
    if args.find_capacity:
        return _find_capacity(args, spec, opts, progress, run_dir)
    try:
        if args.attach:
            result = run_attached(args.attach, args.admin_token, spec, opts, progress)
        else:
            with running(spec, run_dir) as cluster:
                result = run_fleet(spec, cluster, opts, progress)
    finally:
        progress.close()
    result = finish(result, started)
    result["meta"] = {
        "fleet": args.fleet, "workers": [w.id for w in spec.workers], "time_scale": spec.time_scale,
        "load": args.load, "rate": args.rate, "duration_s": args.duration, "drain_s": args.drain,
        "seed": args.seed, "attach": args.attach, "run_dir": None if args.attach else str(run_dir),
    }  # fmt: skip
    for wl, p in result["plans"].items():
        cap, rate = p.get("capacity_rps"), p.get("rate_rps")
        unit = p.get("unit", "requests")
        print(f"{wl}: {p['requests']} {unit} at {rate} {unit}/s"
              + (f", {p['turns']} turns planned to end at {p['planned_end_s']} s" if "turns" in p else "")
              + (f" (estimated fleet capacity {cap} {unit}/s)" if cap else "")
              + (f"; prompts ~{p['prompt_tokens_estimate']} tokens by the byte estimate"
                 if p.get("prompt_tokens_estimate") else "")
              + (f"; no routing can do fewer than {p['lora_floor']} LoRA loads" if p.get("lora_floor") else ""))  # fmt: skip
    print()
    print(format_table(result["runs"]))
    print()
    print(format_routing(result["runs"]))
    conv = format_conversations(result["runs"])
    if conv:
        print()
        print(conv)
    lora = format_lora(result["runs"])
    if lora:
        print()
        print(lora)
    for key, baseline in (("ratios", result["baseline"]), ("ratios_affinity", AFFINITY)):
        text = format_ratios(result.get(key) or [], baseline)
        if text:
            print()
            print(text)
    for f in result.get("failed_runs") or ():
        print(f"\nNOT RUN: {f['run']}: its gateway did not start: {f['reason']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    png_path = args.png or args.out.with_suffix(".png")
    png.render(result["runs"], png_path)
    print(f"\nwall time {result['wall_s']} s; JSON {args.out}; PNG {png_path}")
    return 0


def _find_capacity(args: argparse.Namespace, spec: FleetSpec, opts: BenchOptions, progress: Progress,
                   run_dir: Path) -> int:  # fmt: skip
    started = time.monotonic()
    target = args.capacity_ttft if args.capacity_ttft is not None else 0.2 * spec.time_scale
    start = args.capacity_start or args.rate
    if not start:
        estimate = plan(spec, opts.workloads[0], BenchOptions(duration_s=1, workloads=opts.workloads))
        start = max(1.0, round(estimate["capacity_rps"] or 2.0, 1))
    print(f"capacity search: {opts.workloads[0]} with {AFFINITY}, TTFT p50 < {target:g} s, from {start:g} req/s, "
          f"{opts.duration_s:g} s per step", flush=True)  # fmt: skip
    kw = {"target_p50": target, "start": start}
    try:
        if args.attach:
            result = run_capacity(spec, opts, progress, attach=args.attach, admin_token=args.admin_token, **kw)
        else:
            with running(spec, run_dir) as cluster:
                result = run_capacity(spec, opts, progress, cluster=cluster, **kw)
    finally:
        progress.close()
    result["wall_s"] = round(time.monotonic() - started, 1)
    print(format_table([{**r, "policy": f"{r['policy']} at {r['rate']:g}/s"} for r in result["runs"]]))
    rate = result["capacity_rps"]
    print(f"\ncapacity rate: {rate if rate is not None else 'none found'} req/s "
          f"({AFFINITY} TTFT p50 < {target:g} s); wall time {result['wall_s']} s; JSON {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
