"""Does the measured speed follow the engines' real speed? Issue 37's tracking table.

`speed_starts run` keeps each start's raw record (start<k>-raw.json: every request's outcome
and the gateway's per-second speed readings). Cut into bins of BIN_S seconds, each bin gives
the truth, the client's median time between a streamed answer's tokens on each worker
(for the requests whose decode is centred in that bin), and the estimate, the mean of the
gateway's speed readings in the bin. With two workers both become one ratio (worker 0 over
worker 1, faster = larger): when the engines really run at different speeds, the speeds
should differ by as much, and the point is whether the estimate follows the truth.

    python -m fleetgate_tools.bench.speed_track DIR      # DIR: the start<k>-raw.json files
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

BIN_S = 5.0
_RAW = re.compile(r"start(\d+)-raw\.json")


def _tpot(o: Mapping[str, Any]) -> float | None:
    n, ttft, e2e = o.get("out_tokens") or 0, o.get("ttft"), o.get("e2e")
    if o.get("error") or n < 2 or ttft is None or e2e is None:
        return None
    return float(e2e - ttft) / (n - 1)


def bins(raw: Mapping[str, Any], bin_s: float = BIN_S) -> list[dict[str, Any]]:
    """One row per bin: each worker's client TPOT (median) and speed reading (mean), and the
    two ratios (worker 0 / worker 1: TPOT inverted, so both say how much faster 0 is)."""
    workers = sorted(raw["workers"])[:2]
    per: dict[int, dict[str, list[float]]] = {}
    for o in raw["outcomes"]:
        t = _tpot(o)
        if t is None or o.get("worker") not in workers:
            continue
        middle = o["at"] + o["ttft"] + (o["e2e"] - o["ttft"]) / 2
        per.setdefault(int(middle // bin_s), {}).setdefault(o["worker"], []).append(t)
    reads: dict[int, dict[str, list[float]]] = {}
    for at, reading in raw["readings"]:
        for w in workers:
            if (s := (reading.get(w) or {}).get("speed")) is not None:
                reads.setdefault(int(at // bin_s), {}).setdefault(w, []).append(float(s))
    rows = []
    for b in sorted(set(per) & set(reads)):
        tp, sp = per[b], reads[b]
        if not all(tp.get(w) and sp.get(w) for w in workers) or len(workers) < 2:
            continue
        t0, t1 = (statistics.median(tp[w]) for w in workers)
        s0, s1 = (statistics.fmean(sp[w]) for w in workers)
        rows.append({"from_s": b * bin_s, "tpot": [t0, t1], "speed": [s0, s1],
                     "truth": t1 / t0, "estimate": s0 / s1, "n": [len(tp[w]) for w in workers]})  # fmt: skip
    return rows


def agreement(rows: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """How well the estimate follows the truth over the bins: the correlation of their logs,
    the median |log(estimate / truth)| as a ratio, and the largest truth (how far apart the
    engines really were)."""
    if len(rows) < 3:
        return {"correlation": None, "median_error": None, "truth_max": None}
    x = [math.log(r["truth"]) for r in rows]
    y = [math.log(r["estimate"]) for r in rows]
    corr = statistics.correlation(x, y) if statistics.pstdev(x) > 0 and statistics.pstdev(y) > 0 else None
    err = statistics.median(abs(b - a) for a, b in zip(x, y, strict=True))
    spread = max(max(r["truth"], 1 / r["truth"]) for r in rows)
    return {"correlation": None if corr is None else round(corr, 3), "median_error": round(math.exp(err) - 1, 3),
            "truth_max": round(spread - 1, 3)}  # fmt: skip


def markdown(folder: Path) -> str:
    lines = ["## Does the speed follow the engines? (client TPOT against the gateway's speeds, "
             f"{BIN_S:g}-s bins)", "",
             "truth: worker 0's speed over worker 1's as the client saw it (the inverse ratio of their "
             "median times between tokens); estimate: the same ratio of the gateway's speed readings. "
             "Per start: the correlation of the two (logs), the median gap between them, and how far "
             "apart the engines really were at most.", ""]  # fmt: skip
    for path in sorted(folder.glob("start*-raw.json"), key=lambda p: p.name):
        m = _RAW.fullmatch(path.name)
        if not m:
            continue
        raw = json.loads(path.read_text())
        rows = bins(raw)
        a = agreement(rows)
        w0, w1 = sorted(raw["workers"])[:2]
        gap = "-" if a["median_error"] is None else f"{100 * a['median_error']:.0f}%"
        apart = "-" if a["truth_max"] is None else f"{100 * a['truth_max']:.0f}%"
        cells = "; ".join(f"{r['from_s']:.0f}: {1000 * r['tpot'][0]:.1f}/{1000 * r['tpot'][1]:.1f}, "
                          f"{r['truth']:.2f}, {r['estimate']:.2f}" for r in rows)  # fmt: skip
        lines.append(f"- start {m[1]}: correlation {a['correlation']}, median gap {gap}, engines up to {apart} "
                     f"apart; bins (s: TPOT ms {w0}/{w1}, truth, estimate): {cells}")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(markdown(Path(args[0])), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
