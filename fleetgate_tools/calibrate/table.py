"""The comparison's verdict: each figure's vLLM and simulator medians, their spreads, the
sim/vLLM ratio, PASS within TOLERANCE."""

from __future__ import annotations

import statistics

TOLERANCE = 0.25
DISTURBED = 0.5  # a group whose vLLM figures spread more than this is measured again

ROWS = (
    ("c1", "ttft_p50_c1", "TTFT p50 @1 (s)"), ("c4", "ttft_p50_c4", "TTFT p50 @4 (s)"),
    ("c16", "ttft_p50_c16", "TTFT p50 @16 (s)"), ("c1", "tok_s_c1", "output tok/s @1"),
    ("c4", "tok_s_c4", "output tok/s @4"), ("c16", "tok_s_c16", "output tok/s @16"),
    ("prefix", "prefix_cache_hits", "prefix hits (tokens)"),
    ("prefix", "prefix_cache_queries", "prefix queries (tokens)"),
    ("c16", "overload_peak_waiting", "overload: peak waiting"),
    ("c16", "overload_ttft_p90", "overload: TTFT p90 (s)"),
)  # fmt: skip


# Figures the fit pass was made to reproduce (on its own, earlier runs); the rest follow
# from the model.
FITTED = {"ttft_p50_c1", "tok_s_c1", "tok_s_c4", "tok_s_c16"}


def _spread(values: list[float]) -> float:
    med = statistics.median(values)
    return (max(values) - min(values)) / med if med else 0.0


def median_figures(reps: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in reps) for k in reps[0]}


def group_spread(reps: list[dict[str, float]], group: str) -> float:
    """The widest spread (max - min over the median) of a group's figures in the table."""
    keys = [key for g, key, _ in ROWS if g == group]
    return max(_spread([r[k] for r in reps]) for k in keys)


def table(
    v: dict[str, list[dict[str, float]]], s: dict[str, list[dict[str, float]]]
) -> tuple[str, bool]:
    head = (f"{'figure':<25}{'vLLM':>9}{'spread':>8}{'sim':>9}{'spread':>8}{'sim/vLLM':>10}"
            f"{'other load':>12}  {'basis':<10}verdict")  # fmt: skip
    lines = [head, "-" * len(head)]
    ok = True
    for group, key, label in ROWS:
        vs, ss = [r[key] for r in v[group]], [r[key] for r in s[group]]
        a, b = statistics.median(vs), statistics.median(ss)
        ratio = b / a if a else (1.0 if b == 0 else float("inf"))
        good = abs(ratio - 1) <= TOLERANCE
        ok &= good
        other = statistics.median(r.get("other_cores", 0.0) for r in v[group])
        load = f"{other:.2f} cores" if group != "prefix" else "-"
        lines.append(f"{label:<25}{a:>9.4g}{_spread(vs):>8.0%}{b:>9.4g}{_spread(ss):>8.0%}"
                     f"{ratio:>10.2f}{load:>12}  {'fitted' if key in FITTED else 'predicted':<10}"
                     f"{'PASS' if good else 'FAIL'}")  # fmt: skip
    return "\n".join(lines), ok
