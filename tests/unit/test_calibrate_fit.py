"""The calibration's pure parts (fleetgate_tools/calibrate): the fit and the verdict table."""

from __future__ import annotations

import pytest

from fleetgate_tools.calibrate.engines import MAX_SEQS
from fleetgate_tools.calibrate.fit import fit
from fleetgate_tools.calibrate.table import ROWS, group_spread, table
from fleetgate_tools.calibrate.workload import OUT, PROMPT

TRUE = {
    "base_step_s": 0.004,
    "decode_per_seq_s": 0.0005,
    "prefill_per_token_s": 2e-5,
    "frontend_per_request_s": 0.0023,
    "frontend_per_token_s": 0.00022,
}
FLOOR = 0.001


def _figures(p: dict[str, float], tpot: dict[int, float] | None = None) -> dict[str, dict[str, float]]:
    """What vLLM would measure if it ran exactly the simulator's step model with profile p."""
    f_req, f_tok = p["frontend_per_request_s"], p["frontend_per_token_s"]
    d = OUT - 1

    def model_tpot(b: int) -> float:
        return (p["base_step_s"] + b * (p["decode_per_seq_s"] + f_tok)
                + (b - 1) * (PROMPT * p["prefill_per_token_s"] + f_req) / d)  # fmt: skip

    tp = tpot or {b: model_tpot(b) for b in (1, 4, MAX_SEQS)}

    def group(requests: int, out: int) -> dict[str, float]:
        return {"requests": requests, "tokens": requests * out,
                "frontend_cpu_s": requests * f_req + requests * out * f_tok}  # fmt: skip

    ttft1 = FLOOR + f_req + p["base_step_s"] + PROMPT * p["prefill_per_token_s"]
    return {
        "admit": group(24, 1),
        "c1": {**group(8, OUT), "ttft_p50_c1": ttft1, "tpot_c1": tp[1]},
        "c4": {**group(16, OUT), "tpot_c4": tp[4]},
        "c16": {"tpot_c16": tp[MAX_SEQS]},
    }


def test_fit_recovers_the_profile_that_produced_the_figures() -> None:
    fitted = fit(_figures(TRUE), FLOOR)
    assert fitted == pytest.approx(TRUE, rel=1e-3)


def test_a_batch_that_does_not_slow_steps_fits_no_negative_decode_cost() -> None:
    figures = _figures(TRUE, tpot={1: 0.006, 4: 0.005, MAX_SEQS: 0.004})
    fitted = fit(figures, FLOOR)
    assert fitted["decode_per_seq_s"] == 0.0
    assert fitted["base_step_s"] == pytest.approx(0.006 - TRUE["frontend_per_token_s"], abs=1e-5)


def _runs(scale: float, key_scale: dict[str, float] | None = None) -> dict[str, list[dict[str, float]]]:
    runs: dict[str, list[dict[str, float]]] = {}
    for group, key, _ in ROWS:
        value = scale * (key_scale or {}).get(key, 1.0)
        runs.setdefault(group, [{}, {}, {}])
        for k, r in enumerate(runs[group]):
            r[key] = value * (1 + 0.1 * (k - 1))  # medians at `value`, spread 20%
    return runs


def test_table_passes_within_25_percent_and_fails_beyond() -> None:
    text, ok = table(_runs(1.0), _runs(1.2))
    assert ok and text.count("PASS") == len(ROWS)
    text, ok = table(_runs(1.0), _runs(1.0, {"tok_s_c16": 1.3}))
    assert not ok
    assert [line for line in text.splitlines() if line.endswith("FAIL")] == [
        next(line for line in text.splitlines() if line.startswith("output tok/s @16"))
    ]


def test_group_spread_is_the_widest_of_the_groups_figures() -> None:
    reps = [{"ttft_p50_c1": 1.0, "tok_s_c1": 100.0}, {"ttft_p50_c1": 1.5, "tok_s_c1": 100.0},
            {"ttft_p50_c1": 1.0, "tok_s_c1": 100.0}]  # fmt: skip
    assert group_spread(reps, "c1") == pytest.approx(0.5)
