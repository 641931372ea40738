"""Tables over many runs of issue 14's and issue 31's scenarios (scripts/gpu_bench.sh `pressure`).

Each run is one `scripts/bench_fleet.py --attach` result named `<scenario>-<strategy>-r<round>.json`
(scenario: pressure, long, longcut, half, skew, three, ample: scripts/gpu_bench_pressure.sh
has their meaning). Every row carries, beside what the client saw (ok/sent, 429s, TTFT,
output tok/s), the engines' own figures sampled during the run (engines.load_stats: requests
waiting, max; running, mean and max; KV use, mean; preemptions); older runs without them
fall back to the `<name>.peaks.json` beside them (the engines' peak waiting / KV use). The
markdown has every run, the mean per scenario and strategy, those means against the
tenant_affinity client's, and the "Done when" checks of the gateway's `fleet` policy:

* pressure: TTFT p50 <= 1.3x and p99 <= 1.5x tenant_affinity's, output tok/s >= 0.97x,
  preemptions <= 5% of round-robin's (direct_round_robin's where it ran), zero 429s;
* ample: TTFT p99 <= 1.3x tenant_affinity's;
* skew: TTFT p99 below tenant_affinity's;
* long, longcut, half, three (issue 31): zero 429s, TTFT p50 <= 1.3x tenant_affinity's.

    python -m fleetgate_tools.bench.tables RESULTS_DIR OUT_DIR      # results-pressure.md + .json
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetgate_tools.bench.report import AFFINITY

SUBJECT = "fleet"
# Rows in this order (others after them, by name).
STRATEGY_ORDER = ("tenant_affinity", "direct_round_robin", "round_robin", "least_outstanding", "fleet")
SCENARIO_ORDER = ("pressure", "long", "longcut", "half", "skew", "three", "ample")
_NAME = re.compile(r"(?P<scenario>[a-z][a-z0-9]*)-(?P<strategy>[a-z_]+(?:\+[a-z_]+=[a-z0-9._]+)*)-r(?P<round>\d+)")
MEAN_KEYS = ("requests", "ok", "ttft_p50", "ttft_p99", "e2e_p99", "out_tok_s", "http_429", "other_errors",
             "preemptions", "prefix_hit_rate", "herded_windows", "off_majority", "eng_waiting_max",
             "eng_running_mean", "eng_running_max", "eng_kv_mean", "out_tokens_mean")  # fmt: skip


def load_runs(folder: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(folder.glob("*-r*.json")):
        m = _NAME.fullmatch(path.stem)
        if not m:
            continue
        data = json.loads(path.read_text())
        run = {k: v for k, v in data["runs"][0].items() if k != "ttft_sorted"}
        peaks_path = path.with_name(path.stem + ".peaks.json")
        peaks = json.loads(peaks_path.read_text()) if peaks_path.exists() else {}
        run.update(scenario=m["scenario"], strategy=m["strategy"], round=int(m["round"]),
                   rate=(data.get("meta") or {}).get("rate"), peaks=peaks,
                   peak_waiting=sum(p.get("waiting", 0) for p in peaks.values()) if peaks else None,
                   peak_kv=max((p.get("kv_cache_usage", 0) for p in peaks.values()), default=None))  # fmt: skip
        if run.get("eng_waiting_max") is None and run["peak_waiting"] is not None:
            run["eng_waiting_max"] = run["peak_waiting"]  # a run from before the in-run sampler
        runs.append(run)
    return sorted(runs, key=lambda r: (*_order(r["scenario"], r["strategy"]), r["round"]))


def _order(scenario: str, strategy: str) -> tuple[tuple[int, str], tuple[int, str]]:
    rank = lambda names, x: (names.index(x) if x in names else len(names), x)  # noqa: E731
    return rank(SCENARIO_ORDER, scenario), rank(STRATEGY_ORDER, strategy)


def means(runs: Sequence[Mapping[str, Any]], keys: Sequence[str] = MEAN_KEYS) -> dict[tuple[str, str], dict[str, Any]]:
    """(scenario, strategy) -> the mean of each of `keys` over its runs, and the run count."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["scenario"], r["strategy"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        row: dict[str, Any] = {"runs": len(rs)}
        for k in keys:
            vals = [r[k] for r in rs if r.get(k) is not None]
            row[k] = statistics.mean(vals) if vals else None
        out[key] = row
    return out


def _ratio(x: Any, y: Any) -> float | None:
    return x / y if x is not None and y else None


def checks(m: Mapping[tuple[str, str], Mapping[str, Any]], subject: str = SUBJECT) -> list[tuple[str, bool | None, str]]:
    """Issue 14's "Done when" for `subject`: (what, passed or None if not measured, figures)."""
    out: list[tuple[str, bool | None, str]] = []

    def check(scenario: str, what: str, key: str, test: Callable[[float], bool],
              base: str = AFFINITY, of_base: bool = True) -> None:  # fmt: skip
        s, b = m.get((scenario, subject)), m.get((scenario, base))
        x = s.get(key) if s else None
        y = b.get(key) if b else None
        label = f"{scenario}: {what}"
        if of_base and x is not None and y == 0:
            # No ratio to a zero (e.g. a baseline that never preempted): as a ratio, any
            # figure above zero is infinitely many times it.
            out.append((label, test(0.0 if x == 0 else math.inf), f"{x:.3g} vs {base}'s 0"))
            return
        value = _ratio(x, y) if of_base else x
        if value is None:
            out.append((label, None, "not measured"))
        else:
            out.append((label, test(value), f"{value:.3g}" + ("x" if of_base else "")))

    check("pressure", "TTFT p50 <= 1.3x tenant_affinity", "ttft_p50", lambda v: v <= 1.3)
    check("pressure", "TTFT p99 <= 1.5x tenant_affinity", "ttft_p99", lambda v: v <= 1.5)
    check("pressure", "output tok/s >= 0.97x tenant_affinity", "out_tok_s", lambda v: v >= 0.97)
    # The client's round-robin where it ran: the gateway's may refuse requests with 429s
    # (which then cannot preempt), so its preemptions understate a cache-blind spread.
    rr = "direct_round_robin" if ("pressure", "direct_round_robin") in m else "round_robin"
    check("pressure", f"preemptions <= 5% of {rr}", "preemptions", lambda v: v <= 0.05, base=rr)
    check("pressure", "zero 429s (mean per run)", "http_429", lambda v: v == 0, of_base=False)
    check("ample", "TTFT p99 <= 1.3x tenant_affinity", "ttft_p99", lambda v: v <= 1.3)
    check("skew", "TTFT p99 below tenant_affinity", "ttft_p99", lambda v: v < 1.0)
    # Issue 31: no refusals where the engines have room, however much max_tokens declares.
    for scenario in ("long", "longcut", "half", "three"):
        if any(k[0] == scenario for k in m):
            check(scenario, "zero 429s (mean per run)", "http_429", lambda v: v == 0, of_base=False)
            check(scenario, "TTFT p50 <= 1.3x tenant_affinity", "ttft_p50", lambda v: v <= 1.3)
    return out


def _f(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if unit == "%":
        return f"{100 * v:.1f}%"
    if unit == "s":
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    if unit == "x":
        return f"{v:.2f}x"
    if isinstance(v, float) and (abs(v) >= 10 or v.is_integer()):
        return f"{v:,.0f}"
    return f"{v:.2f}" if isinstance(v, float) else f"{v:,}"


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def done_when(title: str, checks: Sequence[tuple[str, bool | None, str]]) -> list[str]:
    """An issue's "Done when" checks as a table: each check, PASS / FAIL / -, what was measured."""
    mark = {True: "PASS", False: "FAIL", None: "-"}
    return ["", f"## Done when ({title}), `{SUBJECT}` policy", "",
            *_md(["check", "result", "measured"], [[w, mark[ok], v] for w, ok, v in checks])]


def _running(mean: Any, peak: Any) -> str:
    return "-" if mean is None else f"{mean:.0f} / {_f(peak)}"


def _scenarios(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per scenario: its workload, rate(s) and number of engines."""
    seen: dict[str, tuple[set[str], set[float], set[int]]] = {}
    for r in runs:
        wl, rates, engines = seen.setdefault(r["scenario"], (set(), set(), set()))
        wl.add(str(r.get("workload", "-")))
        if r.get("rate"):
            rates.add(float(r["rate"]))
        engines.add(len(r.get("worker_share") or {}))
    return [f"- {sc}: workload {', '.join(sorted(wl))} at {', '.join(f'{x:g}' for x in sorted(rates)) or '-'} req/s, "
            f"{'/'.join(str(n) for n in sorted(engines))} engines" for sc, (wl, rates, engines) in seen.items()]  # fmt: skip


def markdown(runs: Sequence[Mapping[str, Any]], capacity: Mapping[str, Any] | None = None) -> str:
    lines = ["# Fleet benchmark under KV pressure (issues 14 and 31)", ""]
    if capacity:
        lines += [f"capacity rate: {capacity.get('capacity_rps')} req/s ({capacity.get('strategy')} TTFT p50 < "
                  f"{capacity.get('target_ttft_p50')} s, {len(capacity.get('steps') or [])} steps)", ""]  # fmt: skip
    lines += [*_scenarios(runs), ""]
    lines += ["prompt tokens (engine's count): "
              + (_f(statistics.mean([r["prompt_tokens_mean"] for r in runs if r.get("prompt_tokens_mean")]))
                 if any(r.get("prompt_tokens_mean") for r in runs) else "-"),
              "", "Engine columns: the engines' own gauges, read twice a second during the run "
              "(waiting: max of the sum over the engines; running: mean while requests arrive / max, "
              "summed; KV: mean use over the engines while requests arrive; preemptions: counter delta).",
              "", "## Per run", ""]  # fmt: skip
    rows = []
    for r in runs:
        codes = ", ".join(f"{c} {n}" for c, n in (r.get("http_429_codes") or {}).items()) or "0"
        share = " / ".join(f"{v:.0%}" for v in (r.get("worker_share") or {}).values())
        other = ", ".join(f"{k} {n}" for k, n in (r.get("error_kinds") or {}).items() if k != "http_429") or "0"
        ends = ", ".join(f"{k} {n}" for k, n in (r.get("finish") or {}).items()) or "-"
        rows.append([r["scenario"], r["strategy"], str(r["round"]), _f(r.get("rate")),
                     f"{r.get('ok', '-')}/{r['requests']}", codes, other, _f(r["ttft_p50"], "s"),
                     _f(r["ttft_p99"], "s"), _f(r["e2e_p99"], "s"), _f(r["out_tok_s"]),
                     _f(r.get("eng_waiting_max")), _running(r.get("eng_running_mean"), r.get("eng_running_max")),
                     _f(r.get("eng_kv_mean"), "%"), _f(r.get("preemptions")), _f(r.get("prefix_hit_rate"), "%"),
                     _f(r.get("out_tokens_mean")), ends, share,
                     f"{r.get('herded_windows', 0)}/{r.get('windows', 0)}", _f(r.get("off_majority"), "%")])  # fmt: skip
    lines += _md(["scenario", "strategy", "round", "req/s", "ok/sent", "429s by code", "other errors",
                  "TTFT p50 s", "TTFT p99 s", "E2E p99 s", "out tok/s", "eng waiting max",
                  "eng running mean / max", "eng KV mean", "preemptions", "hit rate", "out tok/answer",
                  "answers ended", "share", "herded s", "off-home"], rows)  # fmt: skip
    m = means(runs)
    lines += ["", "## Mean per scenario and strategy, and against tenant_affinity", ""]
    rows = []
    for (scenario, strategy), row in sorted(m.items(), key=lambda kv: _order(*kv[0])):
        base = m.get((scenario, AFFINITY), {})
        rows.append([scenario, strategy, str(row["runs"]), f"{_f(row['ok'])}/{_f(row['requests'])}",
                     _f(row["http_429"]), _f(row["other_errors"]), _f(row["ttft_p50"], "s"), _f(row["ttft_p99"], "s"),
                     _f(row["e2e_p99"], "s"), _f(row["out_tok_s"]), _f(row["eng_waiting_max"]),
                     _running(row["eng_running_mean"], row["eng_running_max"]), _f(row["eng_kv_mean"], "%"),
                     _f(row["preemptions"]), _f(row["prefix_hit_rate"], "%"), _f(row["herded_windows"]),
                     _f(row["off_majority"], "%"),
                     *(_f(_ratio(row[k], base.get(k)), "x") for k in ("ttft_p50", "ttft_p99", "out_tok_s"))])  # fmt: skip
    lines += _md(["scenario", "strategy", "runs", "ok/sent", "429s", "other errors", "TTFT p50 s", "TTFT p99 s",
                  "E2E p99 s", "out tok/s", "eng waiting max", "eng running mean / max", "eng KV mean",
                  "preemptions", "hit rate", "herded s", "off-home", "p50 / affinity", "p99 / affinity",
                  "tok/s / affinity"], rows)  # fmt: skip
    lines += done_when("issues 14 and 31", checks(m))
    return "\n".join(lines) + "\n"


def write_results(argv: Sequence[str] | None, usage: str | None, name: str,
                  results: Callable[[Path], tuple[str, Mapping[str, Any]]]) -> int:
    """A tables module's command line, `RESULTS_DIR OUT_DIR`: `results(RESULTS_DIR)` gives the
    markdown and the JSON record, written to OUT_DIR/results-<name>.md and .json; the markdown
    is printed too."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(usage, file=sys.stderr)
        return 2
    text, record = results(Path(args[0]))
    out = Path(args[1])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results-{name}.md").write_text(text)
    (out / f"results-{name}.json").write_text(json.dumps(record, indent=1))
    print(text)
    return 0


def results(folder: Path) -> tuple[str, dict[str, Any]]:
    """The markdown and the JSON record of the runs in `folder` (and its capacity.json, if any)."""
    runs = load_runs(folder)
    cap_path = folder / "capacity.json"
    capacity = json.loads(cap_path.read_text()) if cap_path.exists() else None
    if capacity:
        capacity = {k: v for k, v in capacity.items() if k != "runs"}
    return markdown(runs, capacity), {"capacity": capacity, "runs": runs, "checks": checks(means(runs))}


def main(argv: Sequence[str] | None = None) -> int:
    return write_results(argv, __doc__, "pressure", results)


if __name__ == "__main__":
    sys.exit(main())
