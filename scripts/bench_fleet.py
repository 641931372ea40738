#!/usr/bin/env python
"""Compare routing policies on a simulated fleet: same requests, same seed, side by side.

    python scripts/bench_fleet.py                                  # defaults: < 5 min
    python scripts/bench_fleet.py --workloads prefix --policies round_robin,fleet --load 0.9
    python scripts/bench_fleet.py --dump-trace /tmp/t.jsonl        # also write the requests
    python scripts/bench_fleet.py --trace /tmp/t-prefix.jsonl      # replay a trace
    python scripts/bench_fleet.py --attach http://127.0.0.1:8000 --admin-token T

Brings up Redis (FLEETGATE_REDIS_URL, else 127.0.0.1:6379 if it answers, else an embedded
one), the fleet from --fleet as real `python -m workers --engine sim` agents, and for each
workload one gateway per policy; prints the table and ratios against round-robin, writes
JSON and a PNG (TTFT CDFs and throughput bars).
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

from fleetgate.bench import png  # noqa: E402
from fleetgate.bench.cluster import running  # noqa: E402
from fleetgate.bench.fleet import load_fleet  # noqa: E402
from fleetgate.bench.progress import Progress  # noqa: E402
from fleetgate.bench.report import format_ratios, format_table  # noqa: E402
from fleetgate.bench.runner import BenchOptions, finish, run_attached, run_fleet  # noqa: E402
from fleetgate.bench.workloads import WORKLOADS  # noqa: E402

DEFAULT_POLICIES = "round_robin,random,least_outstanding,fleet"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fleet", default=str(ROOT / "config/bench/default.yaml"))
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS))
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma list; ones the gateway does not know are skipped with a warning")
    p.add_argument("--load", type=float, default=0.8, help="fraction of the estimated fleet capacity")
    p.add_argument("--rate", type=float, default=None, help="requests/s (overrides --load)")
    p.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per run")
    p.add_argument("--drain", type=float, default=6.0, help="seconds to wait for stragglers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool", type=int, default=256, help="max open connections")
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
        api_key=args.api_key,
    )  # fmt: skip
    for w in opts.workloads:
        if w not in WORKLOADS:
            raise SystemExit(f"unknown workload {w!r}; known: {', '.join(WORKLOADS)}")
    progress = Progress(runs=1)
    run_dir = args.run_dir or ROOT / ".run/bench" / time.strftime("%Y%m%d-%H%M%S")
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
        print(f"{wl}: {p['requests']} requests at {rate} req/s"
              + (f" (estimated fleet capacity {cap} req/s)" if cap else "")
              + (f"; no routing can do fewer than {p['lora_floor']} LoRA loads" if p.get("lora_floor") else ""))  # fmt: skip
    print()
    print(format_table(result["runs"]))
    text = format_ratios(result["ratios"])
    if text:
        print()
        print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    png_path = args.png or args.out.with_suffix(".png")
    png.render(result["runs"], png_path)
    print(f"\nwall time {result['wall_s']} s; JSON {args.out}; PNG {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
