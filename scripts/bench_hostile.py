#!/usr/bin/env python
"""Hostile clients beside normal traffic: what one gateway process holds, what its honest clients see.

    python scripts/bench_hostile.py        # 2 rounds, 50 big + 1,000 slow + 5,000 idle + 50 stalled: ~8 min
    python scripts/bench_hostile.py --rounds 1 --big 10 --slow 100 --idle 500 --stalled 20 \
        --gateway-set send_timeout_s=5                                               # a quick look
    python scripts/bench_hostile.py --gateway-set header_timeout_s=10              # any gateway setting
    python scripts/bench_hostile.py --json .run/hostile.json

Starts the stack of scripts/bench_overhead.py (Redis, two stub engines behind real agents,
one gateway process with the default limits of docs/operations.md, "Limits on client
connections", and a decoy: a second gateway like it), then each round runs the same normal
traffic through the gateway three times: alone; while the hostile clients of
fleetgate_tools/hostile.py (a process of their own) attack the decoy; and while they attack
the gateway itself. The hostile clients: `--big` connections sending a head that never ends
or one oversized head, `--slow` sending a head one line a second, `--idle` never sending a
byte, `--stalled` sending valid streamed completions (pipelined, each some 600 KB of answer
from the stubs) and reading none of the answer through a tiny receive window, so that only
the send limit (`send_timeout_s`, 60 s by default: each hostile phase then lasts over a
minute) closes them; each reopened as soon as the gateway closes it (a sustained flood: with
the defaults about 1,000 new connections a second). Normal traffic: closed-loop completions, whole (the
stub answers after `--delay-ms`) and streamed (`--chunks` events `--chunk-delay-ms` apart).

The decoy phase has the same processes busy on the machine as the attack on the gateway
(the hostile clients, a gateway refusing them), so "hostile / decoy" is what the attack costs
inside the gateway's own event loop, and "hostile / alone" adds what it costs the machine
(on a 2-core machine shared with the load generator, stubs and hostile clients, most of it).

Prints the gateway's RSS (at the start, and the most in each phase) against the bound the
limits give, its CPU share, normal requests' p50/p99 in each phase with the ratios, and,
per hostile kind, how many connections the gateway ended, with what answer, and how many
within their limit (plus `--slack` seconds, as the hostile clients' own clock sees it). The
soft limit on open files is raised to the hard one here and in the hostile clients'
process; with a hard limit too low for the counts asked, scale them down (the table says
what ran).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fleetgate_tools.hostile import STALL_ANSWER_KIB, STALL_STREAMS, raise_nofile  # noqa: E402
from fleetgate_tools.overhead.runner import LoadGen, Measure, Plan, job_for, measure  # noqa: E402
from fleetgate_tools.overhead.stack import Stack, Target, cpu_seconds, rss_mib  # noqa: E402
from gateway.settings import GatewaySettings, load_settings  # noqa: E402

PHASES = ("alone", "decoy", "hostile")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class RssWatch:
    """The most RSS a process (and its children) had while a phase ran, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> RssWatch:
        self.peak = rss_mib(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def refused(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^fleetgate_front_refused_total\{reason="(\w+)"\} (\S+)$', text, re.M)}


def traffic(loadgen: LoadGen, gw: Target, args: argparse.Namespace) -> dict[str, Measure]:
    plan = Plan(duration_s=args.duration, warmup_s=1.0, chunks=args.chunks)
    return {
        "plain": measure(loadgen, gw, job_for(gw, plan, "plain", args.concurrency, delay_ms=args.delay_ms)),
        "stream": measure(loadgen, gw, job_for(gw, plan, "stream", args.concurrency, chunk_delay_ms=args.chunk_delay_ms)),
    }


def hostile_phase(loadgen: LoadGen, gw: Target, attacked: Target, args: argparse.Namespace,
                  limits: GatewaySettings, out: Path) -> tuple[dict[str, Measure], dict[str, Any], float]:
    """Normal traffic through `gw` while the hostile clients attack `attacked`; their CPU seconds."""
    host, port = attacked.urls[0].removeprefix("http://").rsplit(":", 1)
    plan = {"host": host, "port": int(port), "big": args.big, "slow": args.slow, "idle": args.idle,
            "stalled": args.stalled, "ramp_per_s": args.ramp, "api_key": attacked.api_key}
    proc = subprocess.Popen([sys.executable, "-m", "fleetgate_tools.hostile", json.dumps(plan), str(out)],
                            cwd=ROOT, start_new_session=True)
    started = time.monotonic()
    try:
        ramp_s = (args.big + args.slow + args.idle + args.stalled) / args.ramp + 2.0
        time.sleep(ramp_s)
        measures = traffic(loadgen, gw, args)
        # Long enough for every kind to have met its limit at least once.
        longest = max(limits.header_timeout_s, limits.send_timeout_s if args.stalled else 0.0)
        until = started + max(ramp_s + 1.0, longest + ramp_s + args.slack + 1.0)
        time.sleep(max(0.0, until - time.monotonic()))
        cpu = cpu_seconds(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return measures, json.loads(out.read_text()), cpu


def judge(kinds: dict[str, Any], limits: GatewaySettings, slack: float) -> dict[str, dict[str, Any]]:
    """Per kind: ended by the gateway, within its limit, answers, the slowest, open at the stop."""
    limit_s = {"idle": limits.idle_timeout_s, "slow": limits.header_timeout_s, "big": 1.0,
               "stalled": limits.send_timeout_s}
    out = {}
    for name, kind in kinds.items():
        durations = kind["durations_s"]
        within = sum(d <= limit_s[name] + slack for d in durations)
        stale = [a for a in kind["open_at_stop_s"] if a > limit_s[name] + slack]
        out[name] = {
            "opened": kind["opened"], "ended": len(durations), "within": within,
            "slowest_s": max(durations, default=0.0), "statuses": kind["statuses"],
            "p50_s": _pct(durations, 50), "p99_s": _pct(durations, 99),
            "open_at_stop": len(kind["open_at_stop_s"]), "open_past_limit_at_stop": len(stale),
            "connect_errors": kind["connect_errors"], "limit_s": limit_s[name],
            "max_sent_mib": max(kind["sent_bytes"], default=0) / 2**20,
        }
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(len(s) * q / 100) - 1))] if s else 0.0


def _median(values: list[float]) -> float:
    s = sorted(values)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def render(rounds: list[dict[str, Any]], args: argparse.Namespace, limits: GatewaySettings, nofile: int) -> str:
    lines = [f"# Hostile clients beside normal traffic ({len(rounds)} round(s); gateway defaults"
             f"{' + ' + ' '.join(args.gateway_set) if args.gateway_set else ''}; open-files limit {nofile})",
             "", f"Hostile: {args.big} big-head, {args.slow} slow-head, {args.idle} idle, {args.stalled} stalled "
             "(non-reading) connections, each "
             f"reopened when closed. Normal: C={args.concurrency} closed loop, plain (stub {args.delay_ms:g} ms) and "
             f"stream ({args.chunks} events {args.chunk_delay_ms:g} ms apart), {args.duration:g} s each.", "",
             "Phases: alone; decoy (the hostile clients attack a second gateway on the machine); hostile (they "
             "attack this gateway). p50 / p99 in ms, medians over rounds.", "",
             "| normal traffic | p50 alone / decoy / hostile | p99 alone / decoy / hostile | p99 hostile / alone "
             "| p99 hostile / decoy | req/s alone / decoy / hostile | errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode in ("plain", "stream"):
        got = {p: [r[p]["traffic"][mode] for r in rounds] for p in PHASES}
        fig = {(p, f): _median([m[f] for m in got[p]]) for p in PHASES for f in ("p50", "p99", "rps")}
        errors = sum(m["errors"] for p in PHASES for m in got[p])
        lines.append(
            f"| {mode} | " + " / ".join(f"{fig[p, 'p50']:.1f}" for p in PHASES) + " | "
            + " / ".join(f"{fig[p, 'p99']:.1f}" for p in PHASES) + " | "
            f"{fig['hostile', 'p99'] / fig['alone', 'p99']:.3f} | {fig['hostile', 'p99'] / fig['decoy', 'p99']:.3f} | "
            + " / ".join(f"{fig[p, 'rps']:.0f}" for p in PHASES) + f" | {errors} |")
    lines += ["", "CPU (share of one core, medians over rounds): the gateway "
              + ", ".join(f"{p} {_median([r[p]['gateway_cpu'] for r in rounds]):.2f}" for p in PHASES)
              + "; the hostile clients' process "
              + ", ".join(f"{p} {_median([r[p]['hostile_cpu'] for r in rounds]):.2f}" for p in PHASES[1:]) + "."]
    hostile_conns = args.big + args.slow + args.idle
    per_conn_kib = limits.max_header_bytes / 1024 + 16
    # A stalled connection: its one stream started, once unsent and once kept for a resume (its
    # pipelined others wait unstarted while the writes are paused).
    per_stalled_kib = 2 * STALL_ANSWER_KIB + 16
    lines += ["", "| gateway RSS (MiB) | round " + " | round ".join(str(i + 1) for i in range(len(rounds))) + " |",
              "| --- |" + " ---: |" * len(rounds)]
    lines.append("| at the round's start | " + " | ".join(f"{r['rss_start']:.0f}" for r in rounds) + " |")
    for p in PHASES:
        lines.append(f"| most, {p} | " + " | ".join(f"{r[p]['rss_peak']:.0f}" for r in rounds) + " |")
    bound_mib = (hostile_conns * per_conn_kib + args.stalled * per_stalled_kib) / 1024
    lines.append(f"| bound: start + {hostile_conns:,} x {per_conn_kib:.0f} KiB + {args.stalled:,} stalled x "
                 f"{per_stalled_kib:.0f} KiB | " + " | ".join(f"{r['rss_start'] + bound_mib:.0f}" for r in rounds) + " |")
    lines += ["", "Hostile connections while they attacked the gateway (all rounds; times from the first byte, or "
              "the opening for idle ones, from the requests for stalled ones, to the gateway's close, on the hostile "
              "clients' clock):", "",
              "| hostile kind | limit | opened | ended by the gateway | within limit + "
              f"{args.slack:g} s | end p50 / p99 / max (s) | answers | open at stop (past limit) |",
              "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    names = {"big": "big head (endless / 1 MiB)", "slow": "slow head (a line a second)", "idle": "idle (no byte)",
             "stalled": f"stalled ({STALL_STREAMS} streams, reads none)"}
    limit_text = {"big": f"431 past {limits.max_header_bytes} B", "slow": f"closed at {limits.header_timeout_s:g} s",
                  "idle": f"closed at {limits.idle_timeout_s:g} s",
                  "stalled": f"closed {limits.send_timeout_s:g} s after the writes pause"}
    for name in ("big", "slow", "idle", "stalled"):
        per_round = [r["hostile"]["kinds"][name] for r in rounds]
        statuses: dict[str, int] = {}
        for g in per_round:
            for k, v in g["statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
        lines.append(
            f"| {names[name]} | {limit_text[name]} | {sum(g['opened'] for g in per_round):,} | {sum(g['ended'] for g in per_round):,} "
            f"| {sum(g['within'] for g in per_round):,} | {_median([g['p50_s'] for g in per_round]):.2f} / "
            f"{max(g['p99_s'] for g in per_round):.2f} / {max(g['slowest_s'] for g in per_round):.2f} | "
            + ", ".join(f"{k}: {v:,}" for k, v in sorted(statuses.items()))
            + f" | {sum(g['open_at_stop'] for g in per_round):,} ({sum(g['open_past_limit_at_stop'] for g in per_round)}) |")
    refusals: dict[str, float] = {}
    for r in rounds:
        for k, v in r["hostile"]["refused"].items():
            refusals[k] = refusals.get(k, 0) + v
    lines += ["", "fleetgate_front_refused_total during the hostile phases: "
              + ", ".join(f"{k} {v:,.0f}" for k, v in refusals.items() if v)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--big", type=int, default=50)
    p.add_argument("--slow", type=int, default=1000)
    p.add_argument("--idle", type=int, default=5000)
    p.add_argument("--stalled", type=int, default=50, help="connections that ask for streams and read none")
    p.add_argument("--ramp", type=float, default=2000.0, help="hostile connections opened a second at start")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds per traffic mode and phase")
    p.add_argument("--delay-ms", type=float, default=20.0, help="the stub's time to a whole answer")
    p.add_argument("--chunks", type=int, default=32)
    p.add_argument("--chunk-delay-ms", type=float, default=2.0)
    p.add_argument("--slack", type=float, default=1.0, help="seconds past a limit still counted within it")
    p.add_argument("--gateway-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--run-dir", type=Path, default=None)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    nofile = raise_nofile()
    overrides = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in args.gateway_set)}
    limits = load_settings(None, overrides)
    run_dir = args.run_dir or ROOT / ".run" / "hostile" / time.strftime("%Y%m%d-%H%M%S")
    gateway_args = tuple(a for s in args.gateway_set for a in ("--set", s))
    rounds: list[dict[str, Any]] = []
    log(f"starting the stack (logs in {run_dir})")
    with Stack(run_dir, stubs=2, gateway_workers=(1,), gateway_args=gateway_args,
               extra_gateways=("decoy",)) as stack, tempfile.TemporaryDirectory(prefix="fleetgate-hostile-") as tmp:
        gw, decoy = stack.targets["fleetgate"], stack.targets["decoy"]
        assert gw.pid is not None
        loadgen = LoadGen()
        try:
            traffic(loadgen, gw, argparse.Namespace(**{**vars(args), "duration": 2.0}))  # warm-up
            for n in range(args.rounds):
                record: dict[str, Any] = {"rss_start": rss_mib(gw.pid)}
                for phase in PHASES:
                    log(f"round {n + 1}: normal traffic, {phase}")
                    before, cpu_before, started = refused(gw.urls[0]), cpu_seconds(gw.pid), time.monotonic()
                    kinds: dict[str, Any] = {}
                    with RssWatch(gw.pid) as rss:
                        if phase == "alone":
                            measures, hostile_cpu = traffic(loadgen, gw, args), 0.0
                        else:
                            attacked = gw if phase == "hostile" else decoy
                            measures, kinds, hostile_cpu = hostile_phase(
                                loadgen, gw, attacked, args, limits, Path(tmp) / f"{phase}-{n}.json")
                    wall = time.monotonic() - started
                    after = refused(gw.urls[0])
                    record[phase] = {
                        "traffic": {k: vars(m) for k, m in measures.items()}, "rss_peak": rss.peak,
                        "gateway_cpu": (cpu_seconds(gw.pid) - cpu_before) / wall, "hostile_cpu": hostile_cpu / wall,
                        "kinds": judge(kinds, limits, args.slack) if kinds else {},
                        "refused": {k: after[k] - before.get(k, 0) for k in after}}
                    if phase != "alone":
                        time.sleep(limits.idle_timeout_s + 1)  # the last hostile connections gone
                rounds.append(record)
        finally:
            loadgen.close()
    table = render(rounds, args, limits, nofile)
    print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json), "run_dir": str(run_dir)},
                                         "rounds": rounds}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
