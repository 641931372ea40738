#!/usr/bin/env python3
"""What the gateway costs per request in CPU instructions: counted, not timed.

    python scripts/bench_instructions.py                          # this checkout, plain and stream
    python scripts/bench_instructions.py --baseline /tmp/base     # and another checkout, side by side
        (git worktree add /tmp/base <commit>)

Timings on a shared 2-core machine move by 10-20% from run to run; instructions do not.
This runs the same stack as scripts/bench_overhead.py (Redis, two stub engines and their
agents, the real gateway with its defaults: policy fleet, an API key, metrics, JSON logs)
with each gateway under valgrind's callgrind, instrumentation off. For each mode it sends
warm-up requests, turns instrumentation on (`callgrind_control -i on`), sends `--requests`
more at `--concurrency`, turns it off and dumps: the user-space instructions (Ir) the
gateway process executed for those requests, divided by their number. The kernel's share
(socket writes and reads) is not counted, so this measures the gateway's own code and
libraries; bench_overhead.py measures the whole. A run takes a few minutes (the gateway
starts and runs about 50x slower under valgrind).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetgate_tools.overhead.runner import MODES, LoadGen, Plan, job_for  # noqa: E402
from fleetgate_tools.overhead.stack import Stack, Target  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True, timeout=120)


def _dumped(run_dir: Path, name: str, before: set[Path]) -> int:
    """Ir in the dump `callgrind_control -d` just wrote for target `name`."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = set(run_dir.glob(f"callgrind.{name}.out*")) - before
        for path in new:
            text = path.read_text(errors="replace")
            if (m := re.search(r"^totals:\s+(\d+)", text, re.M)) or (m := re.search(r"^summary:\s+(\d+)", text, re.M)):
                return int(m.group(1))
        time.sleep(0.5)
    raise RuntimeError(f"no callgrind dump for {name} in {run_dir}")


def count(loadgen: LoadGen, target: Target, run_dir: Path, mode: str, requests: int, concurrency: int,
          warmup: int) -> float:
    plan = Plan(rounds=1, duration_s=0.0, warmup_s=0.0, concurrency=(concurrency,), modes=(mode,))
    loadgen.run(job_for(target, plan, mode, concurrency, requests=warmup, warmup_s=0.0))
    assert target.pid is not None
    before = set(run_dir.glob(f"callgrind.{target.name}.out*"))
    _control("-i", "on", str(target.pid))
    result = loadgen.run(job_for(target, plan, mode, concurrency, requests=requests, warmup_s=0.0))
    _control("-i", "off", str(target.pid))
    if result.errors:
        raise RuntimeError(f"{target.name} {mode}: {result.errors} errors ({result.first_error})")
    _control("-d", str(target.pid))
    return _dumped(run_dir, target.name, before) / requests


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, default=None, metavar="DIR", help="another checkout of fleetgate")
    p.add_argument("--modes", default=",".join(MODES), help="plain,stream")
    p.add_argument("--requests", type=int, default=2000, help="counted requests per mode and gateway")
    p.add_argument("--warmup", type=int, default=300, help="uncounted requests before them")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--run-dir", type=Path, default=None, help="logs and dumps (default .run/instructions/<time>)")
    args = p.parse_args(argv)
    if not shutil.which("valgrind") or not shutil.which("callgrind_control"):
        log("valgrind is not installed (apt-get install valgrind)")
        return 2
    run_dir = args.run_dir or ROOT / ".run" / "instructions" / time.strftime("%Y%m%d-%H%M%S")
    modes = [m for m in args.modes.split(",") if m in MODES]
    log(f"starting the stack under callgrind (logs in {run_dir}; the gateways take a minute or two)")
    rows: dict[tuple[str, str], float] = {}
    with Stack(run_dir, stubs=2, baseline=args.baseline, callgrind=True) as stack:
        gateways = [t for n, t in stack.targets.items() if n != "direct"]
        loadgen = LoadGen(1)
        try:
            for mode in modes:
                for target in gateways:
                    rows[(mode, target.name)] = ir = count(loadgen, target, run_dir, mode, args.requests,
                                                           args.concurrency, args.warmup)
                    log(f"{mode} {target.name}: {ir:,.0f} Ir/request")
        finally:
            loadgen.close()
    print(f"User-space instructions (Ir) of the gateway process per request, callgrind; {args.requests} "
          f"requests per row at C={args.concurrency} after {args.warmup} uncounted")
    print(f"{'mode':6}  {'gateway':10}  {'Ir/request':>12}  {'x baseline':>10}")
    for (mode, name), ir in rows.items():
        base = rows.get((mode, "baseline"))
        ratio = f"{ir / base:.3f}" if base else "-"
        print(f"{mode:6}  {name:10}  {ir:12,.0f}  {ratio:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
