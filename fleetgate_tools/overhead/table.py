"""The benchmark's printed report: medians per target, ratios against direct, issue 7's targets."""

from __future__ import annotations

import math
from typing import Any

from fleetgate_tools.overhead.runner import Measure, Report

# Issue 17's targets for fleetgate (this 2-core machine); issue 7's were 0.7 ms, 0.4x, 0.7x,
# 0.6 ms and 1.5 ms, and no bound on the tail.
ADDED_P50_C1_MS = 0.3
ADDED_TTFC_C1_MS = 1.5
RPS_RATIO_C64 = 0.6
P99_RATIO_C64 = 2.0
CHUNKS_RATIO_C64 = 0.85
CPU_PLAIN_MS = 0.15
CPU_STREAM_MS = 1.5
CHUNK_TIMING_MS = 1.0


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def _rows(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) if i > 2 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def measures_table(report: Report) -> str:
    med = report.medians()
    header = ["mode", "C", "target", "req/s", "p50 ms", "p99 ms", "ttfc p50", "ttfc p99",
              "chunks/s", "cpu ms/req", "client cpu", "errors"]
    rows = []
    for (mode, c, name), m in med.items():
        rows.append([mode, str(c), name, _f(m.rps, 0), _f(m.p50), _f(m.p99), _f(m.ttfc50), _f(m.ttfc99),
                     _f(m.chunks_s, 0) if mode == "stream" else "-", _f(m.cpu_ms, 3),
                     _f(m.client_cpu_ms, 3), str(m.errors)])
    return _rows(header, rows)


def ratio_rows(report: Report) -> list[dict[str, Any]]:
    """Per (mode, C, proxy): what it adds over direct, and what it keeps of direct's rate."""
    med = report.medians()
    out = []
    for (mode, c, name), m in med.items():
        if name == "direct" or (mode, c, "direct") not in med:
            continue
        d: Measure = med[(mode, c, "direct")]
        out.append({
            "mode": mode, "concurrency": c, "target": name,
            "added_p50_ms": m.p50 - d.p50, "added_p99_ms": m.p99 - d.p99,
            "added_ttfc_p50_ms": m.ttfc50 - d.ttfc50 if mode == "stream" else None,
            "rps_ratio": m.rps / d.rps if d.rps else None,
            "p99_ratio": m.p99 / d.p99 if d.p99 else None,
            "chunks_ratio": m.chunks_s / d.chunks_s if mode == "stream" and d.chunks_s else None,
            "cpu_ms": m.cpu_ms,
        })
    return out


def ratios_table(report: Report) -> str:
    header = ["mode", "C", "target", "+p50 ms", "+p99 ms", "p99 x", "+ttfc p50", "req/s x", "chunks/s x",
              "cpu ms/req"]
    rows = [[r["mode"], str(r["concurrency"]), r["target"], _f(r["added_p50_ms"]), _f(r["added_p99_ms"]),
             _f(r["p99_ratio"]), _f(r["added_ttfc_p50_ms"]), _f(r["rps_ratio"]), _f(r["chunks_ratio"]),
             _f(r["cpu_ms"], 3)]
            for r in ratio_rows(report)]
    return _rows(header, rows) if rows else "(no proxied runs)"


def timing_diffs(report: Report, name: str) -> list[float]:
    """Per chunk index: the proxy's median transit minus direct's (ms)."""
    direct, via = report.timing.get("direct"), report.timing.get(name)
    if not direct or not via:
        return []
    n = min(len(direct), len(via))
    return [via[k] - direct[k] for k in range(n)]


def timing_lines(report: Report) -> list[str]:
    direct = report.timing.get("direct")
    if not direct:
        return []
    lines = [f"direct: transit per chunk (stub write -> client read) mean {sum(direct) / len(direct):.3f} ms, "
             f"max {max(direct):.3f} ms"]
    for name, transits in report.timing.items():
        diffs = timing_diffs(report, name)
        if name == "direct" or not diffs:
            continue
        lines.append(
            f"{name}: transit mean {sum(transits) / len(transits):.3f} ms, max {max(transits):.3f} ms; "
            f"added over direct: mean {sum(diffs) / len(diffs):+.3f} ms, max {max(diffs):+.3f} ms, "
            f"first chunk {diffs[0]:+.3f} ms"
        )
    return lines


def targets_lines(report: Report) -> list[str]:
    """Issue 17's targets for fleetgate (one process), PASS or FAIL with the measured figure."""
    med = report.medians()
    rows = {(r["mode"], r["concurrency"], r["target"]): r for r in ratio_rows(report)}
    lines = []

    def check(label: str, value: float | None, limit: float, at_most: bool) -> None:
        if value is None or math.isnan(value):
            lines.append(f"  {label}: not measured")
            return
        ok = value <= limit if at_most else value >= limit
        sign = "<=" if at_most else ">="
        lines.append(f"  {'PASS' if ok else 'FAIL'}  {label}: {value:.3f} (target {sign} {limit})")

    get = lambda mode, c, key: rows.get((mode, c, "fleetgate"), {}).get(key)  # noqa: E731
    check("added p50 ms, C=1, non-streaming", get("plain", 1, "added_p50_ms"), ADDED_P50_C1_MS, True)
    check("added ttfc p50 ms, C=1, streaming", get("stream", 1, "added_ttfc_p50_ms"), ADDED_TTFC_C1_MS, True)
    check("req/s x direct, C=64, non-streaming", get("plain", 64, "rps_ratio"), RPS_RATIO_C64, False)
    check("p99 x direct, C=64, non-streaming", get("plain", 64, "p99_ratio"), P99_RATIO_C64, True)
    check("chunks/s x direct, C=64, streaming", get("stream", 64, "chunks_ratio"), CHUNKS_RATIO_C64, False)
    plain = med.get(("plain", 64, "fleetgate"))
    stream = med.get(("stream", 64, "fleetgate"))
    check("cpu ms per non-streaming request, C=64", plain.cpu_ms if plain else None, CPU_PLAIN_MS, True)
    check("cpu ms per 64-chunk stream, C=64", stream.cpu_ms if stream else None, CPU_STREAM_MS, True)
    diffs = timing_diffs(report, "fleetgate")
    check("chunk transit added over direct, max over chunks, ms", max(diffs) if diffs else None,
          CHUNK_TIMING_MS, True)
    return lines


def render(report: Report) -> str:
    parts = ["Medians over rounds (latencies in ms; cpu: CPU ms of the target's process per request "
             "= CPU s per 1,000 requests; client cpu: the load generator's)",
             measures_table(report), "", "Against direct (+: added latency; x: fraction of direct's rate)",
             ratios_table(report)]
    timing = timing_lines(report)
    if timing:
        parts += ["", "Chunk timing (one paced stream at a time; medians per chunk over streams):", *timing]
    if report.rss_mib:
        parts += ["", "RSS: " + "; ".join(f"{n} {a:.1f} -> {b:.1f} MiB" for n, (a, b) in report.rss_mib.items())]
    scaling = scaling_table(report)
    if scaling:
        parts += ["", "Scaling over gateway processes (python -m gateway --workers N; req/s x: of direct's):",
                  scaling]
    if any(t == "fleetgate" for t in report.targets):
        parts += ["", "Issue 17 targets (fleetgate, one process):", *targets_lines(report)]
    parts += [f"note: {n}" for n in report.notes]
    return "\n".join(parts)


def _workers(name: str) -> int | None:
    if name == "fleetgate":
        return 1
    if name.startswith("fleetgate-w") and name[11:].isdigit():
        return int(name[11:])
    return None


def scaling_table(report: Report) -> str:
    """Per (mode, C): req/s of each gateway process count, beside direct and vllm-router."""
    med = report.medians()
    counts = sorted(n for t in report.targets if (n := _workers(t)) is not None)
    if len(counts) < 2:
        return ""
    header = ["mode", "C", "target", "req/s", "req/s x", "p50 ms", "p99 ms", "cpu ms/req", "x 1 process"]
    rows = []
    for mode, c in dict.fromkeys((k[0], k[1]) for k in med):
        direct = med.get((mode, c, "direct"))
        one = med.get((mode, c, "fleetgate"))
        names = ["direct", *(("fleetgate" if n == 1 else f"fleetgate-w{n}") for n in counts), "vllm-router"]
        for name in names:
            m = med.get((mode, c, name))
            if m is None:
                continue
            rows.append([mode, str(c), name, _f(m.rps, 0), _f(m.rps / direct.rps if direct and direct.rps else None),
                         _f(m.p50), _f(m.p99), _f(m.cpu_ms, 3),
                         _f(m.rps / one.rps) if one and one.rps and _workers(name) else "-"])
    return _rows(header, rows)


def as_json(report: Report) -> dict[str, Any]:
    med = report.medians()
    return {
        "targets": report.targets,
        "medians": [{"mode": k[0], "concurrency": k[1], "target": k[2], **vars(m)} for k, m in med.items()],
        "rounds": [{"mode": k[0], "concurrency": k[1], "target": k[2], "runs": [vars(m) for m in v]}
                   for k, v in report.runs.items()],
        "ratios": ratio_rows(report),
        "chunk_timing_ms": report.timing,
        "rss_mib": report.rss_mib,
        "notes": report.notes,
    }
