"""Tables over the runs of issue 36's LoRA benchmark (scripts/gpu_bench.sh `lora-all`).

Each run is one `scripts/bench_fleet.py --attach` result named
`lora<engines>x<slots>-<strategy>-r<round>.json` (lora2x8: two engines of 8 LoRA slots
each). Every row carries what the client saw (ok/sent, 429s, TTFT p50 / p99, output tok/s)
and beside it each engine's own figures: the distinct adapters it had requests for across
the run (`vllm:lora_requests_info`, read twice a second), the most at one time, its slots,
its requests waiting (max) and running (mean). The "Done when" checks of the `fleet` policy:

* 2 x 8 and 3 x 8: TTFT p50 and p99 <= 1.2x adapter_affinity's, output tok/s >= 0.97x;
* 2 x 4: TTFT p99 below adapter_affinity's (which puts 8 adapters on 4 slots).

    python -m fleetgate_tools.bench.lora_tables RESULTS_DIR OUT_DIR   # results-lora.md + .json
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fleetgate_tools.bench.lora import ENGINE_KEYS, engine_columns
from fleetgate_tools.bench.tables import _f, _md, _ratio, done_when, load_runs, means, write_results

SUBJECT = "fleet"
AFFINE = "adapter_affinity"
STRATEGY_ORDER = ("adapter_affinity", "direct_round_robin", "fleet")
_SHAPE = re.compile(r"lora(\d+)x(\d+)")


def shape_of(scenario: str) -> tuple[int, int] | None:
    """(engines, slots) of a scenario name such as lora2x8; None for another name."""
    m = _SHAPE.fullmatch(scenario)
    return (int(m[1]), int(m[2])) if m else None


def _shape_key(scenario: str) -> tuple[int, int]:
    """Shapes by engines, then slots descending: 2 x 8, 2 x 4, 3 x 8."""
    engines, slots = shape_of(scenario) or (0, 0)
    return engines, -slots


def lora_runs(folder: Path) -> list[dict[str, Any]]:
    """The LoRA runs in a results folder, by shape, then strategy, then round."""
    runs = [r for r in load_runs(folder) if shape_of(r["scenario"])]

    def key(r: Mapping[str, Any]) -> tuple[Any, ...]:
        order = STRATEGY_ORDER.index(r["strategy"]) if r["strategy"] in STRATEGY_ORDER else len(STRATEGY_ORDER)
        return *_shape_key(r["scenario"]), order, r["strategy"], r["round"]

    return sorted(runs, key=key)


# (what, figure, test on fleet / adapter_affinity) per shape class.
Check = tuple[str, str, Callable[[float], bool]]
_AMPLE: tuple[Check, ...] = (
    ("TTFT p50 <= 1.2x adapter_affinity", "ttft_p50", lambda v: v <= 1.2),
    ("TTFT p99 <= 1.2x adapter_affinity", "ttft_p99", lambda v: v <= 1.2),
    ("output tok/s >= 0.97x adapter_affinity", "out_tok_s", lambda v: v >= 0.97),
)
_SCARCE: tuple[Check, ...] = (("TTFT p99 below adapter_affinity", "ttft_p99", lambda v: v < 1.0),)


def checks(m: Mapping[tuple[str, str], Mapping[str, Any]],
           subject: str = SUBJECT) -> list[tuple[str, bool | None, str]]:  # fmt: skip
    """Issue 36's "Done when" per shape that ran: (what, passed or None, figures). A shape
    whose slots hold every adapter the affine client sends one engine (16 / engines) is
    held to within 1.2x of it; one with fewer slots to beating its p99."""
    out: list[tuple[str, bool | None, str]] = []
    for scenario in sorted({s for s, _ in m}, key=_shape_key):
        shape = shape_of(scenario)
        if shape is None:
            continue
        engines, slots = shape
        rules = _AMPLE if slots * engines >= 16 else _SCARCE
        s, b = m.get((scenario, subject)), m.get((scenario, AFFINE))
        for what, key, test in rules:
            value = _ratio(s.get(key) if s else None, b.get(key) if b else None)
            label = f"{engines} x {slots}: {what}"
            out.append((label, None, "not measured") if value is None else (label, test(value), f"{value:.3g}x"))
    return out


def _label(scenario: str) -> str:
    shape = shape_of(scenario)
    return f"{shape[0]} x {shape[1]}" if shape else scenario


def markdown(runs: Sequence[Mapping[str, Any]]) -> str:
    lines = ["# LoRA fleets (issue 36): 16 adapters, Zipf 1.0, tenant t calls a{t}", "",
             "Shapes: engines x LoRA slots per engine (`--max-loras`). Engine columns, one figure per "
             "engine in id order: the distinct adapters it had requests for across the run and the most "
             "at one time (vllm:lora_requests_info, read twice a second), its slots, its requests waiting "
             "(max) and running (mean while requests arrive). TTFT and out tok/s as the client measured "
             "them, in real seconds (on simulated engines at time scale T, T times the GPU's).", "",
             "## Per run", ""]  # fmt: skip
    rows = []
    for r in runs:
        cells = engine_columns(r)
        codes = ", ".join(f"{c} {n}" for c, n in (r.get("http_429_codes") or {}).items()) or "0"
        other = ", ".join(f"{k} {n}" for k, n in (r.get("error_kinds") or {}).items() if k != "http_429") or "0"
        rows.append([_label(r["scenario"]), r["strategy"], str(r["round"]), _f(r.get("rate")),
                     f"{r.get('ok', '-')}/{r['requests']}", codes, other, _f(r["ttft_p50"], "s"),
                     _f(r["ttft_p99"], "s"), _f(r["out_tok_s"]), *(cells[k] for k in ENGINE_KEYS)])  # fmt: skip
    lines += _md(["shape", "strategy", "round", "req/s", "ok/sent", "429s", "other errors", "TTFT p50 s",
                  "TTFT p99 s", "out tok/s", *(f"eng {k}" for k in ENGINE_KEYS)], rows)  # fmt: skip
    m = means(runs)
    lines += ["", "## Mean per shape and strategy, against adapter_affinity", ""]
    rows = []
    for scenario, strategy in dict.fromkeys((r["scenario"], r["strategy"]) for r in runs):
        row, base = m[(scenario, strategy)], m.get((scenario, AFFINE), {})
        rows.append([_label(scenario), strategy, str(row["runs"]), _f(row["http_429"]),
                     _f(row["ttft_p50"], "s"), _f(row["ttft_p99"], "s"), _f(row["out_tok_s"]),
                     *(_f(_ratio(row[k], base.get(k)), "x") for k in ("ttft_p50", "ttft_p99", "out_tok_s"))])  # fmt: skip
    lines += _md(["shape", "strategy", "runs", "429s", "TTFT p50 s", "TTFT p99 s", "out tok/s",
                  "p50 / affinity", "p99 / affinity", "tok/s / affinity"], rows)  # fmt: skip
    lines += done_when("issue 36", checks(m))
    return "\n".join(lines) + "\n"


def results(folder: Path) -> tuple[str, dict[str, Any]]:
    """The markdown and the JSON record of the LoRA runs in `folder`."""
    runs = lora_runs(folder)
    return markdown(runs), {"runs": runs, "checks": checks(means(runs))}


def main(argv: Sequence[str] | None = None) -> int:
    return write_results(argv, __doc__, "lora", results)


if __name__ == "__main__":
    sys.exit(main())
