"""Issue 37's GPU proof: two identical engines, started afresh three times, measured alike.

One start (scripts/gpu_bench_speed.sh `speed`) is: two engines with the same flags, each
attached the README's way, a gateway with the default config and the fleet policy, then
`run`: a uniform workload through that gateway (Poisson arrivals, every request the same
shape, each prompt unique from its first token, so no shared prefix lets affinity decide)
while this reads, once a second, every worker's speed and its source from
`GET /admin/workers` (and the start-up probe figure it was seeded with, `start_speed`), and
twice a second the engines' own running / waiting / KV use from their /metrics
(engines.LoadSampler). The request split comes from the `x-fleetgate-worker` header.

`table` turns the starts into results-speed.md / .json, one row per start, with issue 37's
checks: the two speeds within SPEED_TOL of each other at every reading from `settle_s`
(30 s of load) to the end of the arrivals, and each worker's share of the requests within
SPLIT_TOL of an even one (relative: 47.5-52.5% for two). A third check says whether the
workload was the one meant: the engines busy but not saturated (waiting 0 in most samples).

    python -m fleetgate_tools.bench.speed_starts run --gateway URL --admin-token T --start 1 \
        --rate 16 --duration 35 --settle 30 --drain 15 --out DIR/start1.json
    python -m fleetgate_tools.bench.speed_starts table DIR OUT     # results-speed.md + .json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec

from fleetgate_tools.bench import engines, speed_track
from fleetgate_tools.bench.arrivals import poisson_arrivals
from fleetgate_tools.bench.loadgen import Outcome, run_requests
from fleetgate_tools.bench.progress import Progress
from fleetgate_tools.bench.report import percentile
from fleetgate_tools.bench.tables import _f, _md, done_when
from fleetgate_tools.bench.workloads import BYTES_PER_TOKEN, BenchRequest, words
from workers.engines.base import EngineWork
from workers.engines.vllm import parse_vllm_work
from workers.speedometer import sample_speed

SPEED_TOL = 0.05  # the two speeds: max / min - 1
SPLIT_TOL = 0.05  # a worker's share against an even one: |share x n - 1|
BUSY_OK = 0.9  # engines "not saturated": waiting 0 in at least this share of the samples

# One admin reading: seconds since the load began, and per worker its speed figures.
Reading = tuple[float, dict[str, dict[str, Any]]]


def uniform_requests(rate: float, duration: float, seed: int, *, model: str = "m7",
                     prompt_tokens: int = 256, max_tokens: int = 128) -> list[BenchRequest]:  # fmt: skip
    """Poisson arrivals of requests of one shape; the request's number opens its prompt, so
    no two share even their first KV block."""
    rng = random.Random(f"uniform:{seed}")
    out = []
    for i, at in enumerate(poisson_arrivals(rate, duration, seed)):
        head = f"[r{seed}-{i}] "
        text = head + words(rng, max(1, prompt_tokens - len(head) // BYTES_PER_TOKEN))
        out.append(BenchRequest(id=i, at=round(at, 6), model=model, max_tokens=max_tokens, tag="uniform",
                                messages=[{"role": "user", "content": text}]))  # fmt: skip
    return out


async def _read_admin(client: httpx.AsyncClient, gateway: str, token: str) -> dict[str, dict[str, Any]]:
    resp = await client.get(gateway + "/admin/workers", headers={"authorization": f"Bearer {token}"}, timeout=2)
    resp.raise_for_status()
    return {
        w["id"]: {"speed": w.get("speed"), "source": w.get("speed_source"),
                  "start": (w.get("start_speed") or {}).get("value"),
                  "start_source": (w.get("start_speed") or {}).get("source"),
                  "running": (w.get("load") or {}).get("running"), "waiting": (w.get("load") or {}).get("waiting")}
        for w in resp.json()["data"]
    }  # fmt: skip


async def _poll_admin(client: httpx.AsyncClient, gateway: str, token: str, out: list[Reading],
                      every_s: float = 1.0) -> None:  # fmt: skip
    t0 = time.perf_counter()
    while True:
        try:
            out.append((round(time.perf_counter() - t0, 2), await _read_admin(client, gateway, token)))
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        await asyncio.sleep(every_s)


async def engine_work(client: httpx.AsyncClient, workers: Sequence[engines.WorkerRef]) -> dict[str, dict[str, float]]:
    """Every engine's cumulative work counters (vLLM's, as the agents read them), by worker."""
    async def one(w: engines.WorkerRef) -> tuple[str, dict[str, float]]:
        try:
            resp = await client.get(w.url + "/metrics", timeout=5)
        except httpx.HTTPError:
            return w.id, {}
        return w.id, msgspec.to_builtins(parse_vllm_work(resp.text)) if resp.status_code == 200 else {}

    return dict(await asyncio.gather(*(one(w) for w in workers)))


async def run_start(gateway: str, token: str, requests: Sequence[BenchRequest], *, drain_s: float,
                    progress: Progress | None = None) -> dict[str, Any]:  # fmt: skip
    """One start's load: outcomes, the admin readings and the engines' gauge samples."""
    readings: list[Reading] = []
    async with httpx.AsyncClient(timeout=10) as client:
        workers = await engines.list_workers(client, gateway, token)
        before = await _read_admin(client, gateway, token)
        work_before = await engine_work(client, workers)
        poller = asyncio.create_task(_poll_admin(client, gateway, token, readings))
        async with engines.LoadSampler(client, workers) as sampler:
            on_progress = (lambda s, d, t: progress.update(s, d, t)) if progress else None
            outcomes, wall = await run_requests(gateway, list(requests), pool=1024, drain_s=drain_s,
                                                on_progress=on_progress)  # fmt: skip
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        after = await _read_admin(client, gateway, token)
        work_after = await engine_work(client, workers)
    return {"workers": [w.id for w in workers], "idle": before, "end": after, "readings": readings,
            "samples": sampler.samples, "outcomes": outcomes, "wall_s": round(wall, 2),
            "work": {"before": work_before, "after": work_after}}  # fmt: skip


def client_tpot(outcomes: Sequence[Outcome]) -> dict[str, float | None]:
    """Per worker, the median time between a streamed answer's tokens as the client saw it
    (seconds after the first token over the tokens after it): the truth the speeds estimate."""
    per: dict[str, list[float]] = {}
    for o in outcomes:
        if not o.error and o.worker and o.ttft is not None and o.e2e is not None and o.out_tokens > 1:
            per.setdefault(o.worker, []).append((o.e2e - o.ttft) / (o.out_tokens - 1))
    return {w: round(statistics.median(v), 5) for w, v in sorted(per.items())}


def engine_windows(work: Mapping[str, Any] | None, wall_s: float) -> dict[str, dict[str, float | None]]:
    """Per engine, over the whole run, from its own counters: the mean time between a
    sequence's tokens (step_s), sequences decoding and prompt tokens computed per step, and
    the speed the agents' estimator reads from that one window (speedometer.sample_speed)."""
    out: dict[str, dict[str, float | None]] = {}
    for wid, after in ((work or {}).get("after") or {}).items():
        before = ((work or {}).get("before") or {}).get(wid)
        if not after or not before:
            continue
        a, b = msgspec.convert(after, EngineWork), msgspec.convert(before, EngineWork)
        d = EngineWork(generated=a.generated - b.generated, prefilled=a.prefilled - b.prefilled,
                       steps=a.steps - b.steps, latency_sum=a.latency_sum - b.latency_sum,
                       latency_count=a.latency_count - b.latency_count)  # fmt: skip
        out[wid] = {
            "step_s": round(d.latency_sum / d.latency_count, 5) if d.latency_count > 0 else None,
            "decoding": round(d.generated / d.steps, 2) if d.steps > 0 else None,
            "prefill": round(d.prefilled / d.steps, 1) if d.steps > 0 else None,
            "speed": None if (v := sample_speed(d, wall_s)) is None else round(v, 3),
        }
    return out


def engine_figures(samples: Sequence[engines.Sample], window_s: float) -> dict[str, dict[str, float | None]]:
    """Per engine, over the samples taken while requests arrived: running, waiting and KV use
    (mean and max), and the share of samples with a request waiting."""
    inside = [s for t, s in samples if s and t <= window_s]
    out: dict[str, dict[str, float | None]] = {}
    for wid in sorted({w for s in inside for w in s}):
        mine = [s[wid] for s in inside if wid in s]
        fig: dict[str, float | None] = {}
        for key in ("running", "waiting", "kv"):
            vals = [g[key] for g in mine if key in g]
            fig[f"{key}_mean"] = round(statistics.fmean(vals), 4) if vals else None
            fig[f"{key}_max"] = max(vals) if vals else None
        waits = [g.get("waiting", 0.0) for g in mine]
        fig["waiting_share"] = round(sum(w > 0 for w in waits) / len(waits), 3) if waits else None
        out[wid] = fig
    return out


def _diff(a: float | None, b: float | None) -> float | None:
    """max / min - 1 of two positive figures."""
    return max(a, b) / min(a, b) - 1 if a and b else None


def summarise_start(start: int, run: Mapping[str, Any], *, duration_s: float, settle_s: float,
                    meta: Mapping[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One table row's figures from run_start's result (with the outcomes as dicts or Outcomes)."""
    outcomes = [o if isinstance(o, Outcome) else msgspec.convert(o, Outcome) for o in run["outcomes"]]
    ids = sorted(run["workers"])
    first = run["readings"][0][1] if run["readings"] else run.get("idle") or {}
    # Readings after `settle_s` of load, up to the end of the arrivals (the last one before
    # it when none falls inside: a shortened dry run).
    loaded = [(t, r) for t, r in run["readings"] if settle_s <= t <= duration_s and all(w in r for w in ids)]
    if not loaded:
        loaded = [(t, r) for t, r in run["readings"] if t <= duration_s and all(w in r for w in ids)][-1:]
    diffs = [d for _, r in loaded if (d := _diff(*(r[w]["speed"] for w in ids[:2]))) is not None]
    last = loaded[-1][1] if loaded else {}
    ok = [o for o in outcomes if not o.error]
    split = Counter({w: 0 for w in ids})
    split.update(o.worker for o in ok if o.worker)
    total = sum(split.values())
    off_even = max((abs(n * len(ids) / total - 1) for n in split.values()), default=None) if total else None
    figures = engine_figures(run["samples"], duration_s)
    wait_share = max((f["waiting_share"] or 0.0 for f in figures.values()), default=None) if figures else None
    ttfts = [o.ttft for o in ok if o.ttft is not None]
    return {
        "start": start, **(meta or {}),
        "workers": ids,
        "probe": {w: first.get(w, {}).get("start") for w in ids},
        "probe_source": {w: first.get(w, {}).get("start_source") for w in ids},
        "speed": {w: last.get(w, {}).get("speed") for w in ids},
        "speed_source": {w: last.get(w, {}).get("source") for w in ids},
        "speed_at_s": loaded[-1][0] if loaded else None,
        "readings_used": len(loaded),
        "probe_diff": _diff(*(first.get(w, {}).get("start") for w in ids[:2])) if len(ids) >= 2 else None,
        "speed_diff": _diff(*(last.get(w, {}).get("speed") for w in ids[:2])) if last and len(ids) >= 2 else None,
        "speed_diff_max": max(diffs) if diffs else None,
        "split": dict(split), "split_off_even": off_even,
        "split_ratio": _diff(*split.values()) if len(split) == 2 else None,
        "routes": dict(Counter((o.route or "-").split(":")[-1] for o in ok)),
        "sent": len(outcomes), "ok": len(ok),
        "errors": dict(Counter(o.error for o in outcomes if o.error)),
        "ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
        "out_tok_s": round(sum(o.out_tokens for o in ok) / run["wall_s"], 1) if run.get("wall_s") else None,
        "engines": figures, "waiting_share_max": wait_share,
        "client_tpot": (tpot := client_tpot(ok)),
        "tpot_diff": _diff(*list(tpot.values())[:2]) if len(tpot) >= 2 else None,
        "engine_window": engine_windows(run.get("work"), float(run.get("wall_s") or 0.0)),
        "trace": [(t, {w: r[w]["speed"] for w in ids if w in r}) for t, r in run["readings"]],
    }  # fmt: skip


def checks(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """Issue 37's GPU checks, per start."""
    out: list[tuple[str, bool | None, str]] = []
    for r in rows:
        s, d, off, busy = r["start"], r.get("speed_diff_max"), r.get("split_off_even"), r.get("waiting_share_max")
        out.append((f"start {s}: speeds within {SPEED_TOL:.0%} (every reading after {_f(r.get('settle_s'))} s)",
                    None if d is None else d <= SPEED_TOL, "-" if d is None else f"{100 * d:.1f}% at most"))
        out.append((f"start {s}: request split within {SPLIT_TOL:.0%} of even",
                    None if off is None else off <= SPLIT_TOL, "-" if off is None else f"{100 * off:.1f}% off"))
        out.append((f"start {s}: engines not saturated (waiting 0 in >= {BUSY_OK:.0%} of samples)",
                    None if busy is None else 1 - busy >= BUSY_OK,
                    "-" if busy is None else f"waiting in {100 * busy:.0f}% of samples"))  # fmt: skip
    return out


def _pair(values: Mapping[str, Any], unit: str = "") -> str:
    return " / ".join(_f(v, unit) if v is not None else "-" for v in values.values())


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ms_pair(values: Mapping[str, Any]) -> str:
    return " / ".join("-" if v is None else f"{1000 * v:.1f}" for v in values.values()) or "-"


def _window(windows: Mapping[str, Mapping[str, Any]]) -> str:
    """Each engine's whole-run window: its mean step, the step's size, the speed it reads as."""
    return "; ".join(
        "-" if w.get("step_s") is None else
        f"{1000 * w['step_s']:.1f} ({_f(w.get('decoding'))}+{_f(w.get('prefill'))}) -> {_f(w.get('speed'))}"
        for w in windows.values()) or "-"  # fmt: skip


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    mark = {True: "PASS", False: "FAIL", None: "-"}
    lines = ["# Worker speed on two identical engines, three fresh starts (issue 37)", ""]
    if rows:
        r0 = rows[0]
        lines += [f"- workload: uniform, Poisson at {_f(r0.get('rate'))} req/s for {_f(r0.get('duration_s'))} s, "
                  f"prompts of ~{r0.get('prompt_tokens')} tokens (each unique from its first token), "
                  f"max_tokens {r0.get('max_tokens')}; gateway policy fleet, default config",
                  f"- workers (each row's pairs in this order): {', '.join(r0['workers'])}",
                  "- probe: the agent's start-up figure (`start_speed`); speed: `/admin/workers` at the end "
                  "of the arrivals; diff: max / min - 1 (worst: over every reading after the settle time); "
                  "off even: the largest |share x workers - 1|; engine columns: the engines' own /metrics, "
                  "read twice a second while requests arrived, mean / max, one engine after the other (;); "
                  "client TPOT: the median time between a streamed answer's tokens as the client saw them, "
                  "per worker (the truth the speeds estimate); eng step: each engine's own mean time "
                  "between tokens over the whole run, the sequences decoding and prompt tokens computed "
                  "per step, and the speed the agents' estimator reads from that one window"]  # fmt: skip
    lines += ["", "## Per start", ""]
    table = []
    for r in rows:
        c = {w: checks([r])[i] for i, w in enumerate(("speed", "split"))}
        eng = list((r.get("engines") or {}).values())
        cell = {key: "; ".join(f"{_f(f.get(key + '_mean'))}/{_f(f.get(key + '_max'))}" for f in eng) or "-"
                for key in ("running", "waiting")}  # fmt: skip
        kv = "; ".join(f"{_pct(f.get('kv_mean'))}/{_pct(f.get('kv_max'))}" for f in eng) or "-"
        table.append([
            str(r["start"]) + (f" ({r['first']} first)" if r.get("first") else ""), f"{_f(r.get('engine_start_s'))} / {_f(r.get('ready_s'))}", _pair(r["probe"]), _pct(r.get("probe_diff")),
            _pair(r["speed"]) + f" ({', '.join(sorted(set(map(str, r['speed_source'].values()))))})",
            _pct(r.get("speed_diff")), _pct(r.get("speed_diff_max")), mark[c["speed"][1]],
            " / ".join(str(n) for n in r["split"].values()) + f" of {r['sent']}"
            + "".join(f", {k} {n}" for k, n in (r.get("errors") or {}).items()), _pct(r.get("split_off_even")),
            mark[c["split"][1]], cell["running"], cell["waiting"], kv, _f(r.get("ttft_p50"), "s"),
            _f(r.get("out_tok_s")), _ms_pair(r.get("client_tpot") or {}), _pct(r.get("tpot_diff")),
            _window(r.get("engine_window") or {}),
        ])  # fmt: skip
    lines += _md(["start", "engines healthy / workers ready s", "probe speeds", "probe diff",
                  "speeds after load (source)", "diff", "worst diff", "speed check", "requests",
                  "off even", "split check",
                  "eng running mean/max", "eng waiting mean/max", "eng KV mean/max", "TTFT p50 s",
                  "out tok/s", "client TPOT ms", "TPOT diff", "eng step ms (decoding+prefill/step) -> speed"],
                 table)  # fmt: skip
    lines += done_when("issue 37, on the GPU", checks(rows))
    return "\n".join(lines) + "\n"


_ROW = re.compile(r"start\d+\.json")


def load_rows(folder: Path) -> list[dict[str, Any]]:
    return sorted((json.loads(p.read_text()) for p in folder.glob("start*.json") if _ROW.fullmatch(p.name)),
                  key=lambda r: r["start"])  # fmt: skip


def _run(args: argparse.Namespace) -> int:
    reqs = uniform_requests(args.rate, args.duration, args.seed, prompt_tokens=args.prompt_tokens,
                            max_tokens=args.max_tokens, model=args.model)  # fmt: skip
    progress = Progress(runs=1)
    progress.start_run(f"start {args.start}: uniform at {args.rate:g}/s", len(reqs))
    try:
        run = asyncio.run(run_start(args.gateway.rstrip("/"), args.admin_token, reqs, drain_s=args.drain,
                                    progress=progress))  # fmt: skip
    finally:
        progress.close()
    meta = {"rate": args.rate, "duration_s": args.duration, "settle_s": args.settle, "seed": args.seed,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
            "engine_start_s": args.engine_start_s, "ready_s": args.ready_s, "first": args.first}  # fmt: skip
    row = summarise_start(args.start, run, duration_s=args.duration, settle_s=args.settle, meta=meta)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=1))
    raw = {**run, "outcomes": msgspec.to_builtins(run["outcomes"])}
    args.out.with_name(args.out.name.split(".")[0] + "-raw.json").write_text(json.dumps(raw))
    print(markdown([row]))
    return 0


def _table(folder: Path, out: Path) -> int:
    rows = load_rows(folder)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows) + "\n" + speed_track.markdown(folder)
    (out / "results-speed.md").write_text(text)
    (out / "results-speed.json").write_text(json.dumps({"rows": rows, "checks": checks(rows)}, indent=1))
    print(text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one start's load and readings")
    r.add_argument("--gateway", required=True)
    r.add_argument("--admin-token", required=True)
    r.add_argument("--start", type=int, required=True)
    r.add_argument("--rate", type=float, default=16.0)
    r.add_argument("--duration", type=float, default=35.0)
    r.add_argument("--settle", type=float, default=30.0, help="speeds are compared from this much load on")
    r.add_argument("--drain", type=float, default=15.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--prompt-tokens", type=int, default=256)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--model", default="m7")
    r.add_argument("--engine-start-s", type=float, default=None, help="recorded beside the row")
    r.add_argument("--ready-s", type=float, default=None, help="recorded beside the row")
    r.add_argument("--first", default=None, help="the engine launched first (recorded beside the row)")
    r.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("table", help="results-speed.md / .json from DIR's start<k>.json")
    t.add_argument("folder", type=Path)
    t.add_argument("out", type=Path)
    args = p.parse_args(argv)
    return _run(args) if args.cmd == "run" else _table(args.folder, args.out)


if __name__ == "__main__":
    sys.exit(main())
