"""Tables of the multi-turn benchmark (issue 31): the terminal table of one invocation
(scripts/bench_fleet.py --workloads multiturn) and the markdown over many GPU runs
(scripts/gpu_bench.sh multiturn-all).

Each GPU run is one `scripts/bench_fleet.py --attach` result named
`<scenario>-<strategy>-r<round>.json` (scenario mt2 or mt3: two or three engines; the
strategy as spelled, e.g. `fleet+kv_events=true`). Every row has what the client saw (turns
ok / sent / planned, 429s, TTFT p50 / p99 over all turns and over the later turns, output
tok/s), the engines' own prefix-cache hit rate (vllm:prefix_cache_hits_total /
queries_total deltas) and preemptions, the share of turns that moved to another engine than
the turn before, and the engines' gauges sampled during the run (waiting max, running mean /
max, KV use mean). The "Done when" of issue 31 compares the precise policy with today's:

* TTFT p99 of `fleet+kv_events=false` >= 1.5x that of `fleet+kv_events=true`;
* a higher engine-reported hit rate for `fleet+kv_events=true`;
* no 429s from `fleet+kv_events=true`.

    python -m fleetgate_tools.bench.multiturn_tables RESULTS_DIR OUT_DIR   # results-multiturn.md + .json
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetgate_tools.bench.report import ENGINE_HEADER, _fmt, _table, engine_cells
from fleetgate_tools.bench.tables import _f, _md, _ratio, means, write_results

PRECISE = "fleet+kv_events=true"
PLACED = "fleet+kv_events=false"
STRATEGY_ORDER = ("conversation_affinity", "direct_round_robin", PLACED, PRECISE)
_NAME = re.compile(r"(?P<scenario>mt\d+)-(?P<strategy>.+)-r(?P<round>\d+)")
MEAN_KEYS = ("requests", "ok", "turns_planned", "http_429", "other_errors", "ttft_p50", "ttft_p99",
             "ttft_p50_later", "ttft_p99_later", "out_tok_s", "prefix_hit_rate", "preemptions", "moved",
             "eng_waiting_max", "eng_running_mean", "eng_running_max", "eng_kv_mean")  # fmt: skip


def _turns(r: Mapping[str, Any]) -> str:
    return f"{r.get('ok', '-')}/{r['requests']}/{r.get('turns_planned', '-')}"


def format_conversations(runs: Sequence[Mapping[str, Any]]) -> str:
    """The terminal table of a conversation workload's runs ("" when none ran one)."""
    rows = []
    for r in runs:
        if r.get("turns_planned") is None:
            continue
        label = r["policy"] + (f" r{r['round']}" if r.get("round") is not None else "")
        rows.append([
            r["workload"], label, f"{r.get('conversations_completed', 0)}/{r.get('conversations', 0)}",
            _turns(r), str(r.get("http_429", 0)), _fmt(r.get("ttft_p50_first"), "s"), _fmt(r.get("ttft_p99_first"), "s"),
            _fmt(r.get("ttft_p50_later"), "s"), _fmt(r.get("ttft_p99_later"), "s"), _fmt(r.get("prefix_hit_rate"), "%"),
            _fmt(r.get("moved"), "%"), _fmt(r.get("later_prompt_tokens_mean")), _live(r),
            "-" if r.get("preemptions") is None else f"{r['preemptions']:.0f}", r.get("kv_events_workers") or "-",
            *engine_cells(r),
        ])  # fmt: skip
    if not rows:
        return ""
    header = ["workload", "policy", "conv done", "turns ok/sent/plan", "429", "TTFT 1st p50", "p99",
              "TTFT later p50", "p99", "hit%", "moved", "prompt tok", "live ctx/KV", "preempt", "KV events", *ENGINE_HEADER]  # fmt: skip
    return ("conversations (TTFT of first turns and of later ones; hit%: the engines' own counters; "
            "moved: later turns on another engine than the turn before; live ctx/KV: the context the live "
            "conversations held, mean, over the fleet's KV cache; KV events: engines whose KV cache events the "
            "gateway had an index of at the end):\n" + _table(header, rows))  # fmt: skip


def _live(r: Mapping[str, Any]) -> str:
    """The live conversations' context over the fleet's KV cache: "1.9x (126k / 67k)"."""
    ratio, live, kv = r.get("live_over_kv"), r.get("live_tokens_mean"), r.get("fleet_kv_tokens")
    if live is None:
        return "-"
    if ratio is None or not kv:
        return f"{live / 1000:.0f}k"
    return f"{ratio:.1f}x ({live / 1000:.0f}k / {kv / 1000:.0f}k)"


# ---------------------------------------------------------------- the GPU runs' markdown


def load_runs(folder: Path) -> list[dict[str, Any]]:
    runs = []
    for path in sorted(folder.glob("mt*-r*.json")):
        m = _NAME.fullmatch(path.stem)
        if not m or path.stem.endswith(".tmp"):
            continue
        data = json.loads(path.read_text())
        run = {k: v for k, v in data["runs"][0].items() if k != "ttft_sorted"}
        run.update(scenario=m["scenario"], strategy=run.get("policy") or m["strategy"], round=int(m["round"]),
                   rate=(data.get("meta") or {}).get("rate"), plan=(data.get("plans") or {}).get("multiturn"))  # fmt: skip
        runs.append(run)
    return sorted(runs, key=lambda r: (r["scenario"], _rank(r["strategy"]), r["round"]))


def _rank(strategy: str) -> tuple[int, str]:
    k = STRATEGY_ORDER.index(strategy) if strategy in STRATEGY_ORDER else len(STRATEGY_ORDER)
    return k, strategy


def checks(m: Mapping[tuple[str, str], Mapping[str, Any]]) -> list[tuple[str, bool | None, str]]:
    """Issue 31's multi-turn "Done when" per scenario: (what, passed or None, figures)."""
    out: list[tuple[str, bool | None, str]] = []
    for scenario in sorted({s for s, _ in m}):
        p, f = m.get((scenario, PRECISE)), m.get((scenario, PLACED))
        gain = _ratio(f.get("ttft_p99") if f else None, p.get("ttft_p99") if p else None)
        out.append((f"{scenario}: TTFT p99 of {PLACED} >= 1.5x {PRECISE}'s",
                    None if gain is None else gain >= 1.5, "not measured" if gain is None else f"{gain:.2f}x"))  # fmt: skip
        hp, hf = (p or {}).get("prefix_hit_rate"), (f or {}).get("prefix_hit_rate")
        out.append((f"{scenario}: engine hit rate of {PRECISE} above {PLACED}'s",
                    None if hp is None or hf is None else hp > hf,
                    "not measured" if hp is None or hf is None else f"{_f(hp, '%')} vs {_f(hf, '%')}"))  # fmt: skip
        n429 = (p or {}).get("http_429")
        out.append((f"{scenario}: {PRECISE} zero 429s", None if n429 is None else n429 == 0,
                    "not measured" if n429 is None else _f(n429)))  # fmt: skip
    return out


def _running(mean: Any, peak: Any) -> str:
    return "-" if mean is None else f"{mean:.0f} / {_f(peak)}"


def markdown(runs: Sequence[Mapping[str, Any]]) -> str:
    lines = ["# Multi-turn conversations under KV pressure (issue 31)", ""]
    for scenario in sorted({r["scenario"] for r in runs}):
        r0 = next(r for r in runs if r["scenario"] == scenario)
        plan = r0.get("plan") or {}
        lines.append(f"- {scenario}: {len(r0.get('worker_share') or {})} engines, {plan.get('requests', '-')} "
                     f"conversations ({plan.get('turns', '-')} turns) at {_f(r0.get('rate'))} a second, "
                     f"planned end {_f(plan.get('planned_end_s'))} s")  # fmt: skip
    lines += ["", "Turns ok / sent / planned: a turn is sent when the one before it has been answered "
              "(and its think time passed); a failed turn ends its conversation. TTFT over all turns "
              "sent and over the later turns (2nd on). Hit rate: the engines' own prefix-cache counters. "
              "Moved: later turns served by another engine than the turn before. Live context / KV: the "
              "tokens the live conversations held (each its last answered prompt + answer, from that "
              "turn's start until its next), mean after the first 10 s, over the engines' KV caches. KV "
              "events: the engines whose KV cache events the gateway had an index of at the run's end "
              "(0/N: no policy could route on them). "
              "Engine columns: the "
              "engines' gauges read twice a second (waiting: max of the sum; running: mean while "
              "conversations are planned / max; KV: mean use).", "", "## Per run", ""]  # fmt: skip
    rows = []
    for r in runs:
        codes = ", ".join(f"{c} {n}" for c, n in (r.get("http_429_codes") or {}).items()) or "0"
        other = ", ".join(f"{k} {n}" for k, n in (r.get("error_kinds") or {}).items() if k != "http_429") or "0"
        rows.append([r["scenario"], r["strategy"], str(r["round"]), _turns(r), codes, other,
                     _f(r.get("ttft_p50"), "s"), _f(r.get("ttft_p99"), "s"), _f(r.get("ttft_p50_later"), "s"),
                     _f(r.get("ttft_p99_later"), "s"), _f(r.get("out_tok_s")), _f(r.get("prefix_hit_rate"), "%"),
                     _f(r.get("preemptions")), _f(r.get("moved"), "%"), _f(r.get("later_prompt_tokens_mean")),
                     _live(r), r.get("kv_events_workers") or "-", _f(r.get("eng_waiting_max")), _running(r.get("eng_running_mean"), r.get("eng_running_max")),
                     _f(r.get("eng_kv_mean"), "%"), ", ".join(r.get("routing_ignored") or []) or "-"])  # fmt: skip
    lines += _md(["scenario", "strategy", "round", "turns ok/sent/planned", "429s", "other errors", "TTFT p50 s",
                  "TTFT p99 s", "later TTFT p50 s", "later TTFT p99 s", "out tok/s", "hit rate", "preemptions",
                  "moved", "prompt tok (later)", "live context / KV", "KV events", "eng waiting max", "eng running mean / max", "eng KV mean",
                  "options ignored"], rows)  # fmt: skip
    m = means(runs, MEAN_KEYS)
    lines += ["", "## Mean per scenario and strategy", ""]
    rows = []
    for (scenario, strategy), row in sorted(m.items(), key=lambda kv: (kv[0][0], _rank(kv[0][1]))):
        placed = m.get((scenario, PLACED), {})
        rows.append([scenario, strategy, str(row["runs"]), f"{_f(row['ok'])}/{_f(row['requests'])}/{_f(row['turns_planned'])}",
                     _f(row["http_429"]), _f(row["ttft_p50"], "s"), _f(row["ttft_p99"], "s"),
                     _f(row["ttft_p99_later"], "s"), _f(row["out_tok_s"]), _f(row["prefix_hit_rate"], "%"),
                     _f(row["preemptions"]), _f(row["moved"], "%"), _f(row["eng_waiting_max"]),
                     _running(row["eng_running_mean"], row["eng_running_max"]), _f(row["eng_kv_mean"], "%"),
                     _f(_ratio(placed.get("ttft_p99"), row["ttft_p99"]), "x")])  # fmt: skip
    lines += _md(["scenario", "strategy", "runs", "turns ok/sent/planned", "429s", "TTFT p50 s", "TTFT p99 s",
                  "later TTFT p99 s", "out tok/s", "hit rate", "preemptions", "moved", "eng waiting max",
                  "eng running mean / max", "eng KV mean", f"{PLACED} p99 / this p99"], rows)  # fmt: skip
    mark = {True: "PASS", False: "FAIL", None: "-"}
    lines += ["", "## Done when (issue 31, multi-turn)", "",
              *_md(["check", "result", "measured"], [[w, mark[ok], v] for w, ok, v in checks(m)])]  # fmt: skip
    return "\n".join(lines) + "\n"


def results(folder: Path) -> tuple[str, dict[str, Any]]:
    """The markdown and the JSON record of the multi-turn runs in `folder`."""
    runs = load_runs(folder)
    return markdown(runs), {"runs": runs, "checks": checks(means(runs, MEAN_KEYS))}


def main(argv: Sequence[str] | None = None) -> int:
    return write_results(argv, __doc__, "multiturn", results)


if __name__ == "__main__":
    sys.exit(main())
