#!/usr/bin/env python
"""What the gateway costs per request: fleetgate (and vllm-router) against going direct to the engines.

    python scripts/bench_overhead.py                        # 3 rounds x {1,16,64} x {plain,stream}: ~4 min
    python scripts/bench_overhead.py --rounds 5 --duration 5 --concurrency 1,64
    python scripts/bench_overhead.py --no-router --json .run/overhead.json
    python scripts/bench_overhead.py --baseline /tmp/base --concurrency 64 --no-router   # vs another checkout
    python scripts/bench_overhead.py --soak 600             # 10 min of load, RSS every 30 s
    python scripts/bench_overhead.py --gateway-workers 1,2,4,8 --concurrency 64,256 --modes plain \
        --stubs 4 --loadgen-procs 4                         # the scaling table (a machine with cores)

Starts Redis (FLEETGATE_REDIS_URL, else 127.0.0.1:6379 if it answers, else an embedded
one), two stub engines (fleetgate_tools/overhead/stub.py) registered by real agents
(`python -m workers --engine external`), the real gateway (policy fleet, an API key,
metrics, JSON logs at info into its log file) and, when installed (.venv-router or
PATH), vllm-router in front of the same stubs. A closed-loop load generator in its own
process runs every (mode, concurrency) against each target in turn, rounds interleaved,
and prints medians, ratios against direct, the chunk-timing comparison and issue 7's
targets. Progress goes to stderr; logs of every process to --run-dir.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetgate_tools.overhead.runner import MODES, Plan, run, soak  # noqa: E402
from fleetgate_tools.overhead.stack import Stack, find_router  # noqa: E402
from fleetgate_tools.overhead.table import as_json, render  # noqa: E402


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=2.5, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds before each run")
    p.add_argument("--concurrency", type=_ints, default=(1, 16, 64), help="comma list (default 1,16,64)")
    p.add_argument("--modes", default=",".join(MODES), help="plain,stream")
    p.add_argument("--chunks", type=int, default=64, help="chunks per stream")
    p.add_argument("--timing-requests", type=int, default=8,
                   help="streams per target in the chunk-timing run (0: skip it)")
    p.add_argument("--chunk-delay-ms", type=float, default=10.0, help="per-chunk delay of the timing run")
    p.add_argument("--router", default=None, help="vllm-router executable (default: .venv-router's)")
    p.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    p.add_argument("--router-policy", default="cache_aware", help="vllm-router's --policy (its default)")
    p.add_argument("--gateway-workers", type=_ints, default=(1,), metavar="N,N,...",
                   help="one fleetgate per count, each `python -m gateway --workers N` (default 1); "
                        "more than one count adds the scaling table")
    p.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                   help="another checkout of fleetgate (e.g. `git worktree add /tmp/base HEAD~1`): its "
                        "gateway is one more target, `baseline`, in the same interleaved rounds")
    p.add_argument("--stubs", type=int, default=2, help="stub engines (default 2)")
    p.add_argument("--loadgen-procs", type=int, default=1,
                   help="load generator processes sharing each run's clients (default 1)")
    p.add_argument("--soak", type=float, default=0.0, metavar="SECONDS",
                   help="instead: load the gateway this long (C=64), printing RSS every 30 s")
    p.add_argument("--soak-concurrency", type=int, default=64)
    p.add_argument("--hold", action="store_true",
                   help="after the run, keep the stack up until Ctrl-C (to attach a profiler)")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    p.add_argument("--run-dir", type=Path, default=None, help="logs (default .run/overhead/<time>)")
    return p


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the stack's processes are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_dir = args.run_dir or ROOT / ".run" / "overhead" / time.strftime("%Y%m%d-%H%M%S")
    router = None if args.no_router or args.soak else find_router(args.router)
    notes = []
    if not args.no_router and not args.soak and router is None:
        notes.append("vllm-router is not installed (python -m venv .venv-router && "
                     ".venv-router/bin/pip install vllm-router): no third column")
    plan = Plan(
        rounds=args.rounds, duration_s=args.duration, warmup_s=args.warmup, concurrency=args.concurrency,
        modes=tuple(m for m in args.modes.split(",") if m in MODES), chunks=args.chunks,
        timing_requests=args.timing_requests, timing_chunk_delay_ms=args.chunk_delay_ms,
        loadgen_procs=args.loadgen_procs,
    )
    log(f"starting the stack (logs in {run_dir})")
    with Stack(run_dir, stubs=args.stubs, router=router, router_policy=args.router_policy,
               gateway_workers=args.gateway_workers, baseline=args.baseline) as stack:
        targets = list(stack.targets.values())
        log("targets: " + ", ".join(f"{t.name} {' '.join(t.urls)}" + (f" pid {t.pid}" if t.pid else "")
                                    for t in targets))
        if args.soak:
            gw = next(t for n, t in stack.targets.items() if n.startswith("fleetgate"))
            samples = soak(gw, plan, args.soak, args.soak_concurrency, log)
            first, last = samples[0][2], samples[-1][2]
            print(f"soak {args.soak:.0f}s at C={args.soak_concurrency}: gateway RSS {first:.1f} -> "
                  f"{last:.1f} MiB ({last - first:+.1f}); max {max(s[2] for s in samples):.1f} MiB")
            for t, rps, rss in samples:
                print(f"  {t:6.0f}s  {rps:8.0f} req/s  {rss:8.1f} MiB")
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"soak": samples}, indent=1))
            return 0
        report = run(targets, plan, log)
        report.notes.extend(notes)
        report.notes.append(f"vllm-router --policy {args.router_policy}" if router else "")
        report.notes = [n for n in report.notes if n]
        print(render(report))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(as_json(report), indent=1))
            log(f"wrote {args.json}")
        if args.hold:
            gw = next(t for n, t in stack.targets.items() if n.startswith("fleetgate"))
            log(f"holding the stack up; Ctrl-C to stop. gateway {gw.urls[0]} pid {gw.pid} "
                f"api key {gw.api_key}; direct {' '.join(stack.targets['direct'].urls)}")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
