"""Figures of one run, the side-by-side tables, ratios against a baseline, and JSON.

Ratios are taken against round-robin (the gateway's, else the client's direct one) and,
where the run has it, against the tenant-affinity client (issue 14's oracle).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from fleetgate_tools.bench.herding import Routed, herding, off_majority
from fleetgate_tools.bench.loadgen import ERROR_KINDS, Outcome

BASELINE = "round_robin"
AFFINITY = "tenant_affinity"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of unsorted values; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def summarise(
    workload: str,
    policy: str,
    outcomes: Sequence[Outcome],
    wall_s: float,
    engine_deltas: Mapping[str, Mapping[str, float]],
    all_workers: Sequence[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    ok = [o for o in outcomes if not o.error]
    # Timed-out requests count with their censored TTFT (a lower bound), so a policy cannot
    # look good by leaving its slowest requests unfinished.
    timed = [o for o in outcomes if o.ttft is not None and (not o.error or o.error == "timeout")]
    ttfts = [o.ttft for o in timed if o.ttft is not None]
    # The later half of the arrivals: a queue that grows through the run shows there first.
    mid = (min(o.at for o in outcomes) + max(o.at for o in outcomes)) / 2 if outcomes else 0.0
    late = [o.ttft for o in timed if o.ttft is not None and o.at >= mid]
    e2es = [o.e2e for o in ok if o.e2e is not None]
    kinds = Counter(o.error for o in outcomes if o.error)
    workers = Counter({w: 0 for w in all_workers})
    workers.update(o.worker for o in outcomes if o.worker)
    total = sum(workers.values()) or 1

    def engine_sum(key: str) -> float | None:
        values = [d[key] for d in engine_deltas.values() if key in d]
        return sum(values) if values else None

    hits, queries = engine_sum("prefix_hits"), engine_sum("prefix_queries")
    routed = [Routed(o.at, o.worker, o.tag) for o in outcomes]
    herd = herding(routed)
    away = off_majority(routed)
    codes = Counter(o.code or "-" for o in outcomes if o.error == "http_429")
    # The engines' own count of prompt tokens (usage), where they reported it: the real
    # tokenizer's, which differs from the workload's byte estimate on a real vLLM.
    prompts = [o.prompt_tokens for o in outcomes if o.prompt_tokens]
    # How the answers ended: the engine's finish_reason, or "cut" by the client
    # (BenchRequest.answer_tokens); "-" where none was seen.
    finish = Counter(o.finish or "-" for o in ok)
    return {
        "workload": workload,
        "policy": policy,
        "requests": len(outcomes),
        "ok": len(ok),
        "wall_s": round(wall_s, 3),
        "rps": round(len(ok) / wall_s, 3) if wall_s else 0.0,
        "out_tok_s": round(sum(o.out_tokens for o in outcomes) / wall_s, 1) if wall_s else 0.0,
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p90": percentile(ttfts, 90),
        "ttft_p99": percentile(ttfts, 99),
        "ttft_p50_late": percentile(late, 50),
        "e2e_p50": percentile(e2es, 50),
        "e2e_p99": percentile(e2es, 99),
        "errors": sum(kinds.values()),
        "http_429": kinds.get("http_429", 0),
        "http_429_codes": dict(sorted(codes.items())),
        "other_errors": sum(kinds.values()) - kinds.get("http_429", 0),
        "engine_ctx_400": kinds.get("engine_ctx_400", 0),
        "error_kinds": {k: kinds[k] for k in ERROR_KINDS if kinds.get(k)},
        "prefix_hit_rate": round(hits / queries, 4) if hits is not None and queries else None,
        "prefix_hit_tokens": hits,
        "prefix_query_tokens": queries,
        "lora_loads": engine_sum("lora_loads"),
        "lora_api_loads": engine_sum("lora_api_loads"),
        "preemptions": engine_sum("preemptions"),
        "worker_share": {w: round(n / total, 3) for w, n in sorted(workers.items())},
        "herded_windows": herd.herded,
        "windows": herd.windows,
        "off_majority": None if away is None else round(away, 4),
        "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
        "out_tokens_mean": round(sum(o.out_tokens for o in ok) / len(ok), 1) if ok else None,
        "finish": dict(sorted(finish.items())),
        "engines": {w: dict(d) for w, d in sorted(engine_deltas.items())},
        "ttft_sorted": [round(t, 4) for t in sorted(ttfts)],
        "error_samples": sorted({o.message for o in outcomes if o.error and o.message})[:3],
        **extra,
    }


# Figures compared against the baseline: (key, label).
RATIO_KEYS = (
    ("rps", "req/s"), ("out_tok_s", "tok/s"), ("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"),
    ("e2e_p99", "E2E p99"), ("prefix_hit_rate", "hit rate"), ("lora_loads", "LoRA loads"),
    ("preemptions", "preempt"),
)  # fmt: skip


def round_robin_baseline(runs: Sequence[Mapping[str, Any]]) -> str:
    """The gateway's round_robin if it ran, else the client's direct_round_robin."""
    names = {r["policy"] for r in runs}
    return BASELINE if BASELINE in names or "direct_round_robin" not in names else "direct_round_robin"


def ratios(runs: Sequence[Mapping[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Each run's figures divided by the baseline policy's on the same workload (and the
    same round, when runs carry one)."""
    base: dict[tuple[str, Any], Mapping[str, Any]] = {}
    for r in runs:
        if r["policy"] == baseline:
            base.setdefault((r["workload"], r.get("round")), r)
            base.setdefault((r["workload"], None), r)
    out = []
    for r in runs:
        b = base.get((r["workload"], r.get("round"))) or base.get((r["workload"], None))
        if b is None:
            continue
        row: dict[str, Any] = {"workload": r["workload"], "policy": r["policy"]}
        if r.get("round") is not None:
            row["round"] = r["round"]
        for key, _ in RATIO_KEYS:
            x, y = r.get(key), b.get(key)
            row[key] = round(x / y, 3) if x is not None and y else None
        out.append(row)
    return out


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if unit == "s":
            return f"{v:.3f}" if v < 10 else f"{v:.1f}"
        if unit == "%":
            return f"{100 * v:.1f}%"
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 1 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True)))  # fmt: skip
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def engine_cells(r: Mapping[str, Any]) -> list[str]:
    """The engines' own figures of a run (engines.load_stats), as table cells: requests
    waiting (max, summed over the engines), running (mean/max, summed), KV use (mean)."""
    run_mean, run_max = r.get("eng_running_mean"), r.get("eng_running_max")
    running = "-" if run_mean is None else f"{run_mean:.0f}/{run_max:.0f}"
    return [_count(r.get("eng_waiting_max")), running, _fmt(r.get("eng_kv_mean"), "%")]


ENGINE_HEADER = ["eng wait max", "eng run mean/max", "eng KV mean"]


def _count(v: Any) -> str:
    return "-" if v is None else f"{v:.0f}"


def format_table(runs: Sequence[Mapping[str, Any]]) -> str:
    header = ["workload", "policy", "ok/sent", "req/s", "tok/s", "TTFT p50", "p90", "p99",
              "E2E p50", "p99", "err", "429", "ctx400", "hit%", "LoRA ld", "preempt",
              *ENGINE_HEADER, "share"]  # fmt: skip
    rows = []
    for r in runs:
        share = " ".join(f"{v:.0%}" for v in r["worker_share"].values())
        loads = r["lora_loads"]
        if loads is not None and r.get("lora_api_loads"):
            loads = f"{loads:.0f}+{r['lora_api_loads']:.0f}"
        rows.append([
            r["workload"], r["policy"], f"{r.get('ok', '-')}/{r['requests']}", _fmt(r["rps"]),
            _fmt(r["out_tok_s"]), _fmt(r["ttft_p50"], "s"), _fmt(r["ttft_p90"], "s"), _fmt(r["ttft_p99"], "s"),
            _fmt(r["e2e_p50"], "s"), _fmt(r["e2e_p99"], "s"), str(r["errors"]),
            str(r["http_429"]), str(r["engine_ctx_400"]), _fmt(r["prefix_hit_rate"], "%"),
            _fmt(loads if not isinstance(loads, float) else int(loads)),
            _fmt(None if r["preemptions"] is None else int(r["preemptions"])), *engine_cells(r), share,
        ])  # fmt: skip
    return _table(header, rows)


def format_routing(runs: Sequence[Mapping[str, Any]]) -> str:
    """Where requests went and why some were refused: 429s by the body's `code`, other
    errors, preemptions, herded 1-s windows, requests off their tenant's majority worker,
    and the engines' mean prompt length in their own tokens."""
    header = ["workload", "policy", "429 by code", "other err", "preempt", "herded/windows",
              "off-home", "prompt tok", "out tok", "answers ended"]  # fmt: skip
    rows = []
    for r in runs:
        codes = ", ".join(f"{c} {n}" for c, n in (r.get("http_429_codes") or {}).items()) or "0"
        rows.append([
            r["workload"], r["policy"] + (f" r{r['round']}" if r.get("round") is not None else ""),
            codes, str(r.get("other_errors", "-")),
            _fmt(None if r["preemptions"] is None else int(r["preemptions"])),
            f"{r.get('herded_windows', 0)}/{r.get('windows', 0)}",
            _fmt(r.get("off_majority"), "%"), _fmt(r.get("prompt_tokens_mean")),
            _fmt(r.get("out_tokens_mean")), format_finish(r.get("finish")),
        ])  # fmt: skip
    return _table(header, rows)


def format_finish(finish: Mapping[str, int] | None) -> str:
    """How a run's answers ended: "stop 61, cut 1800" (cut: the client closed the stream)."""
    return ", ".join(f"{k} {n}" for k, n in (finish or {}).items()) or "-"


def format_ratios(rows: Sequence[Mapping[str, Any]], baseline: str = BASELINE) -> str:
    header = ["workload", "policy", *(f"{label} x" for _, label in RATIO_KEYS)]
    label = lambda r: r["policy"] + (f" r{r['round']}" if r.get("round") is not None else "")  # noqa: E731
    body = [[r["workload"], label(r), *(_fmt(r[k]) for k, _ in RATIO_KEYS)] for r in rows
            if r["policy"] != baseline]  # fmt: skip
    if not body:
        return ""
    return f"ratios against {baseline} (same workload, same seed):\n" + _table(header, body)
