"""Figures of one run, the side-by-side table, ratios against round-robin, and JSON."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from fleetgate.bench.loadgen import ERROR_KINDS, Outcome

BASELINE = "round_robin"


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
    ttfts = [o.ttft for o in outcomes if o.ttft is not None and (not o.error or o.error == "timeout")]
    e2es = [o.e2e for o in ok if o.e2e is not None]
    kinds = Counter(o.error for o in outcomes if o.error)
    workers = Counter({w: 0 for w in all_workers})
    workers.update(o.worker for o in outcomes if o.worker)
    total = sum(workers.values()) or 1

    def engine_sum(key: str) -> float | None:
        values = [d[key] for d in engine_deltas.values() if key in d]
        return sum(values) if values else None

    hits, queries = engine_sum("prefix_hits"), engine_sum("prefix_queries")
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
        "e2e_p50": percentile(e2es, 50),
        "e2e_p99": percentile(e2es, 99),
        "errors": sum(kinds.values()),
        "http_429": kinds.get("http_429", 0),
        "engine_ctx_400": kinds.get("engine_ctx_400", 0),
        "error_kinds": {k: kinds[k] for k in ERROR_KINDS if kinds.get(k)},
        "prefix_hit_rate": round(hits / queries, 4) if hits is not None and queries else None,
        "prefix_hit_tokens": hits,
        "prefix_query_tokens": queries,
        "lora_loads": engine_sum("lora_loads"),
        "lora_api_loads": engine_sum("lora_api_loads"),
        "preemptions": engine_sum("preemptions"),
        "worker_share": {w: round(n / total, 3) for w, n in sorted(workers.items())},
        "engines": {w: dict(d) for w, d in sorted(engine_deltas.items())},
        "ttft_sorted": [round(t, 4) for t in sorted(ttfts)],
        "error_samples": sorted({o.message for o in outcomes if o.error and o.message})[:3],
        **extra,
    }


# Figures compared against the baseline: (key, label).
RATIO_KEYS = (
    ("rps", "req/s"), ("out_tok_s", "tok/s"), ("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"),
    ("e2e_p99", "E2E p99"), ("prefix_hit_rate", "hit rate"), ("lora_loads", "LoRA loads"),
)  # fmt: skip


def ratios(runs: Sequence[Mapping[str, Any]], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """Each run's figures divided by the baseline policy's on the same workload."""
    base = {r["workload"]: r for r in runs if r["policy"] == baseline}
    out = []
    for r in runs:
        b = base.get(r["workload"])
        if b is None:
            continue
        row: dict[str, Any] = {"workload": r["workload"], "policy": r["policy"]}
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


def format_table(runs: Sequence[Mapping[str, Any]]) -> str:
    header = ["workload", "policy", "req", "req/s", "tok/s", "TTFT p50", "p90", "p99",
              "E2E p50", "p99", "err", "429", "ctx400", "hit%", "LoRA ld", "preempt", "share"]  # fmt: skip
    rows = []
    for r in runs:
        share = " ".join(f"{v:.0%}" for v in r["worker_share"].values())
        loads = r["lora_loads"]
        if loads is not None and r.get("lora_api_loads"):
            loads = f"{loads:.0f}+{r['lora_api_loads']:.0f}"
        rows.append([
            r["workload"], r["policy"], str(r["requests"]), _fmt(r["rps"]), _fmt(r["out_tok_s"]),
            _fmt(r["ttft_p50"], "s"), _fmt(r["ttft_p90"], "s"), _fmt(r["ttft_p99"], "s"),
            _fmt(r["e2e_p50"], "s"), _fmt(r["e2e_p99"], "s"), str(r["errors"]),
            str(r["http_429"]), str(r["engine_ctx_400"]), _fmt(r["prefix_hit_rate"], "%"),
            _fmt(loads if not isinstance(loads, float) else int(loads)),
            _fmt(None if r["preemptions"] is None else int(r["preemptions"])), share,
        ])  # fmt: skip
    return _table(header, rows)


def format_ratios(rows: Sequence[Mapping[str, Any]], baseline: str = BASELINE) -> str:
    header = ["workload", "policy", *(f"{label} x" for _, label in RATIO_KEYS)]
    body = [[r["workload"], r["policy"], *(_fmt(r[k]) for k, _ in RATIO_KEYS)] for r in rows
            if r["policy"] != baseline]  # fmt: skip
    if not body:
        return ""
    return f"ratios against {baseline} (same workload, same seed):\n" + _table(header, body)
