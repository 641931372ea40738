"""The fit: the simulator's profile fields (scheduler.py's step model) from vLLM's
measured figures, by weighted least squares."""

from __future__ import annotations

from fleetgate_tools.calibrate.engines import MAX_SEQS
from fleetgate_tools.calibrate.workload import OUT, PROMPT


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Cramer's rule for a 3x3 system."""

    def det(m: list[list[float]]) -> float:
        return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
                - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))  # fmt: skip

    d = det(a)
    out = []
    for col in range(3):
        m = [row[:] for row in a]
        for r in range(3):
            m[r][col] = b[r]
        out.append(det(m) / d)
    return out


def _least_squares(rows: list[tuple[list[float], float, float]]) -> list[float]:
    """Weighted least squares for 3 unknowns: rows of (coefficients, value, weight)."""
    ata = [[sum(w * w * r[i] * r[j] for r, _, w in rows) for j in range(3)] for i in range(3)]
    atb = [sum(w * w * r[i] * y for r, y, w in rows) for i in range(3)]
    return _solve3(ata, atb)


def fit(m: dict[str, dict[str, float]], floor_ttft: float) -> dict[str, float]:
    """Profile fields from vLLM's figures (medians per group), in the simulator's own terms
    (scheduler.py).

    Front-end: the API server process's CPU seconds = f_req x requests + f_tok x tokens,
    over the 1-token requests (admit) and the 64-token ones (c1 + c4): two equations, two
    unknowns. This is measured CPU time, not fitted latency.

    Engine, with P = prompt tokens, D = OUT - 1 decode steps per request and b running
    (1, 4, and 8 = max_num_seqs at concurrency 16):
      TTFT@1 = f_req + base + P x prefill        (admitted, then one prefill step)
      TPOT@b = base + b (decode + f_tok) + (b - 1) (P x prefill + f_req) / D
    (every step decodes b and pays the front-end for the b chunks of the step before; over
    one request's D steps each of the other b - 1 is replaced once: a prefill in some step
    and an admission taking the CPU). Four equations for base, decode and prefill: weighted
    least squares, TTFT@1 held nearly exact.

    `floor_ttft` is the simulator's own TTFT with (nearly) zero step times: its HTTP path
    and the client's, which come on top of any profile, so it is taken off vLLM's TTFT.
    Its own per-token path needs no such correction: the scheduler sleeps to deadlines, so
    that time is hidden inside each step.
    """
    a, c1, c4, c16 = m["admit"], m["c1"], m["c4"], m["c16"]
    n1, t1 = a["requests"], a["tokens"]
    n2, t2 = c1["requests"] + c4["requests"], c1["tokens"] + c4["tokens"]
    cpu1, cpu2 = a["frontend_cpu_s"], c1["frontend_cpu_s"] + c4["frontend_cpu_s"]
    det = n1 * t2 - n2 * t1
    f_req = max((cpu1 * t2 - cpu2 * t1) / det, 0.0)
    f_tok = max((n1 * cpu2 - n2 * cpu1) / det, 0.0)
    d = OUT - 1
    rows = [([1.0, 0.0, PROMPT], c1["ttft_p50_c1"] - floor_ttft - f_req, 10.0)]
    for b, tpot in ((1, c1["tpot_c1"]), (4, c4["tpot_c4"]), (MAX_SEQS, c16["tpot_c16"])):
        rows.append(([1.0, b, (b - 1) * PROMPT / d], tpot - b * f_tok - (b - 1) * f_req / d, 1.0))
    base, decode, prefill = _least_squares(rows)
    if decode < 0:  # noise: no measurable growth with the batch
        decode = 0.0
        base = c1["tpot_c1"] - f_tok
        prefill = (c1["ttft_p50_c1"] - floor_ttft - f_req - base) / PROMPT
    return {
        "base_step_s": round(max(base, 1e-4), 5),
        "decode_per_seq_s": round(decode, 6),
        "prefill_per_token_s": round(max(prefill, 0.0), 8),
        "frontend_per_request_s": round(f_req, 5),
        "frontend_per_token_s": round(f_tok, 6),
    }
