"""Issue 37's GPU proof pieces (scripts/gpu_bench.sh speed-starts): the uniform workload, one
start's row from its readings, the checks and the table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetgate_tools.bench import speed_track
from fleetgate_tools.bench.loadgen import Outcome
from fleetgate_tools.bench.speed_starts import (
    checks,
    engine_figures,
    load_rows,
    markdown,
    summarise_start,
    uniform_requests,
)


def test_uniform_requests_are_one_shape_and_share_no_prefix() -> None:
    """Poisson arrivals of requests alike in size and max_tokens, each prompt unique from its
    first characters (no KV block in common), the same sequence for the same seed."""
    reqs = uniform_requests(16, 35, 0, prompt_tokens=256, max_tokens=128)
    assert 16 * 35 * 0.85 < len(reqs) < 16 * 35 * 1.15
    assert all(0 <= r.at < 35 for r in reqs) and [r.at for r in reqs] == sorted(r.at for r in reqs)
    assert {r.max_tokens for r in reqs} == {128} and all(r.ignore_eos for r in reqs)
    sizes = [r.prompt_tokens() for r in reqs]
    assert max(sizes) - min(sizes) <= 8
    heads = {r.messages[0]["content"][:12] for r in reqs}
    assert len(heads) == len(reqs)
    assert [r.messages for r in uniform_requests(16, 35, 0)] == [r.messages for r in reqs]


def _run(speeds: list[tuple[float, float, float]], split: tuple[int, int], waiting: float = 0.0) -> dict[str, Any]:
    """A start's raw result: admin readings (t, vl0's speed, vl1's), outcomes split as given,
    engine samples with `waiting` on vl1 in every other sample."""
    readings = [(t, {"vl0": {"speed": a, "source": "engine", "start": 1.4, "start_source": "measured"},
                     "vl1": {"speed": b, "source": "engine", "start": 0.8, "start_source": "measured"}})
                for t, a, b in speeds]  # fmt: skip
    outcomes = [Outcome(id=i, tag="uniform", status=200, worker="vl0" if i < split[0] else "vl1", ttft=0.1,
                        e2e=2.0, out_tokens=128, route="fleet:placed") for i in range(sum(split))]  # fmt: skip
    samples = [(t / 2, {"vl0": {"running": 20.0, "waiting": 0.0, "kv": 0.3},
                        "vl1": {"running": 22.0, "waiting": waiting if t % 2 else 0.0, "kv": 0.32}})
               for t in range(70)]  # fmt: skip
    return {"workers": ["vl1", "vl0"], "readings": readings, "outcomes": outcomes, "samples": samples,
            "wall_s": 50.0, "idle": {}}  # fmt: skip


def test_a_start_that_converged_passes() -> None:
    """Probe figures 1.4 / 0.8 that the engines' counters bring to 1.00 / 0.98 by 30 s: the
    speeds pass on every reading from 30 s to the arrivals' end (35 s), a 51/49 split passes,
    and readings before 30 s or after 35 s do not count."""
    speeds = [(5.0, 1.3, 0.8), (30.5, 1.0, 0.98), (34.9, 1.01, 0.99), (40.0, 1.5, 0.5)]
    row = summarise_start(1, _run(speeds, (255, 245)), duration_s=35, settle_s=30, meta={"settle_s": 30})
    assert row["probe"] == {"vl0": 1.4, "vl1": 0.8} and abs(row["probe_diff"] - 0.75) < 1e-9
    assert row["speed"] == {"vl0": 1.01, "vl1": 0.99} and row["speed_at_s"] == 34.9
    assert abs(row["speed_diff_max"] - (1.0 / 0.98 - 1)) < 1e-9 and row["readings_used"] == 2
    assert row["split"] == {"vl0": 255, "vl1": 245} and abs(row["split_off_even"] - 0.02) < 1e-9
    assert row["routes"] == {"placed": 500} and row["ok"] == 500 and row["out_tok_s"] == 1280.0
    assert [ok for _, ok, _ in checks([row])] == [True, True, True]
    assert row["engines"]["vl0"] == {"running_mean": 20.0, "running_max": 20.0, "waiting_mean": 0.0,
                                     "waiting_max": 0.0, "kv_mean": 0.3, "kv_max": 0.3, "waiting_share": 0.0}  # fmt: skip


def test_a_start_that_did_not_converge_fails() -> None:
    """One reading after 30 s 7% apart fails the speeds, a 53/47 split fails the split (6%
    off even), and engines that queue in half the samples fail the load check."""
    speeds = [(31.0, 1.0, 0.99), (33.0, 1.07, 1.0)]
    row = summarise_start(2, _run(speeds, (53, 47), waiting=3.0), duration_s=35, settle_s=30)
    assert [ok for _, ok, _ in checks([row])] == [False, False, False]
    assert engine_figures(_run([], (1, 1), waiting=3.0)["samples"], 35)["vl1"]["waiting_share"] == 0.5


def test_a_short_run_takes_the_last_reading_and_the_table_reads_back(tmp_path: Path) -> None:
    """A dry run shorter than the settle time compares the last reading before the arrivals'
    end; `table` reads start<k>.json only (not the .tmp or -raw files) and prints a row and
    three checks per start."""
    row = summarise_start(3, _run([(4.0, 0.26, 0.26), (9.0, 0.27, 0.27)], (10, 10)), duration_s=12, settle_s=30)
    assert row["readings_used"] == 1 and row["speed_at_s"] == 9.0 and row["speed_diff_max"] == 0.0
    (tmp_path / "start3.json").write_text(json.dumps(row))
    (tmp_path / "start4.tmp.json").write_text("{}")
    (tmp_path / "start3-raw.json").write_text("{}")
    rows = load_rows(tmp_path)
    assert [r["start"] for r in rows] == [3]
    text = markdown(rows)
    assert "| 3 | - / - | 1.40 / 0.80 | 75.0% | 0.27 / 0.27 (engine) | 0.0% | 0.0% | PASS | 10 / 10 of 20 |" in text
    assert text.count("| start 3:") == 3


def _raw(truth: list[float], estimate: list[float]) -> dict[str, object]:
    """A start's raw record with one 5-s bin per pair: in bin i, vl1's answers take 20 ms a
    token and vl0's 20 / truth[i]; the gateway reads vl0 at estimate[i] and vl1 at 1.0."""
    outcomes, readings = [], []
    for i, (t, e) in enumerate(zip(truth, estimate, strict=True)):
        at = 5.0 * i + 1.0
        for w, tpot in (("vl0", 0.02 / t), ("vl1", 0.02)):
            # 11 tokens: the decode (10 x tpot) is centred in the bin
            outcomes.append({"worker": w, "at": at, "ttft": 0.1, "e2e": 0.1 + 10 * tpot, "out_tokens": 11, "error": ""})
        readings.append([5.0 * i + 2.5, {"vl0": {"speed": e}, "vl1": {"speed": 1.0}}])
    return {"workers": ["vl1", "vl0"], "outcomes": outcomes, "readings": readings}


@pytest.mark.parametrize(
    ("truth", "estimate", "correlation", "gap"),
    [
        ([1.0, 1.5, 0.7, 1.2], [1.0, 1.5, 0.7, 1.2], 1.0, 0.0),   # follows exactly
        ([1.0, 1.5, 0.7, 1.2], [1.1, 1.65, 0.77, 1.32], 1.0, 0.1),  # a steady 10% bias
        ([1.0, 1.5, 0.7, 1.2], [1.2, 0.7, 1.5, 1.0], -0.97, None),  # the wrong way round
    ],
)
def test_speed_track_compares_the_clients_truth_with_the_gateways_estimate(
    truth: list[float], estimate: list[float], correlation: float, gap: float | None,
) -> None:
    rows = speed_track.bins(_raw(truth, estimate))
    assert [round(r["truth"], 3) for r in rows] == truth
    assert [round(r["estimate"], 3) for r in rows] == estimate
    got = speed_track.agreement(rows)
    assert got["correlation"] == pytest.approx(correlation, abs=0.01)
    if gap is not None:
        assert got["median_error"] == pytest.approx(gap, abs=0.002)
    assert got["truth_max"] == pytest.approx(0.5, abs=0.001)
