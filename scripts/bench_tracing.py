#!/usr/bin/env python
"""What tracing costs the gateway per request: the hooks of one proxied request, timed in process.

    .venv/bin/python scripts/bench_tracing.py            # ~10 s
    .venv/bin/python scripts/bench_tracing.py --n 200000

Calls the hooks exactly as one request with one attempt does (gateway/request/proxy.py,
gateway/request/attempts.py: start, described, the forward-header merge, attempt, attempt_status,
attempt_end, end) with tracing off (the default) with and without a client traceparent,
and on (the SDK's spans, a batch processor whose exporter drops them: the request's own
thread's share; export runs in the SDK's thread). Prints µs per request, best of 5 runs.
Compare with the gateway's ~260 µs of CPU per plain request (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.observe.tracing import Tracing

HEADERS = {"content-type": "application/json", "x-request-id": "r1"}


def _request_args(traceparent: str | None) -> tuple[Any, Any, Any]:
    raw = [("host", "gw"), ("content-type", "application/json"), ("authorization", "Bearer x"),
           ("user-agent", "OpenAI/Python"), ("accept", "application/json"), ("content-length", "120")]
    if traceparent:
        raw.append(("traceparent", traceparent))
    scope = [(k.encode(), v.encode()) for k, v in raw]

    def header(name: str) -> str | None:  # as gateway/front/fastpath.py reads one
        key = name.encode()
        for k, v in scope:
            if k == key:
                return v.decode("latin-1")
        return None

    slot = SimpleNamespace(id="w1")
    routes = SimpleNamespace(by_model={"m": SimpleNamespace(routable=(slot, SimpleNamespace(id="w2")))})
    attempt = SimpleNamespace(
        dispatch=SimpleNamespace(watcher=SimpleNamespace(snapshot=SimpleNamespace(routes=routes)),
                                 policy=SimpleNamespace(name="fleet")),
        facts=SimpleNamespace(model="m"), tried=["w1"])
    choice = SimpleNamespace(worker=SimpleNamespace(id="w1"), reason="least-load")
    return header, attempt, choice


def one_run(tracing: Tracing, n: int, traceparent: str | None) -> float:
    header, attempt, choice = _request_args(traceparent)
    started = time.perf_counter()
    for _ in range(n):
        trace = tracing.start(header, "/v1/chat/completions", "r1")
        trace.described("m", False)
        headers = {**HEADERS, **trace.forward}
        trace.attempt(headers, attempt, choice, "http://w1:8001/v1/chat/completions")
        trace.attempt_status(200)
        trace.attempt_end()
        trace.end(200)
    return (time.perf_counter() - started) / n * 1e6


def baseline(n: int) -> float:
    """The same loop's merge of the forward headers alone (what the request did before)."""
    started = time.perf_counter()
    for _ in range(n):
        _ = {**HEADERS}
    return (time.perf_counter() - started) / n * 1e6


def best(fn: Any, *args: Any, runs: int = 5) -> float:
    return min(fn(*args) for _ in range(runs))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="requests per run")
    args = parser.parse_args(argv)
    tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    rows = [("headers merge only (before tracing)", best(baseline, args.n)),
            ("off, no client traceparent", best(one_run, Tracing(), args.n, None)),
            ("off, client traceparent forwarded", best(one_run, Tracing(), args.n, tp))]
    try:
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        from gateway.observe.tracing_otel import OtelTracing
    except ImportError:
        print("(OpenTelemetry SDK not installed: the `tracing` extra; on-path figures skipped)")
    else:
        class Drop(SpanExporter):
            def export(self, spans: Any) -> SpanExportResult:
                return SpanExportResult.SUCCESS

        on = OtelTracing.with_processor(BatchSpanProcessor(Drop()), "bench", "bench-1")
        n = max(1, args.n // 10)
        rows += [("on, new trace (2 spans)", best(one_run, on, n, None)),
                 ("on, child of client traceparent (2 spans)", best(one_run, on, n, tp))]
        on.provider.shutdown()
    for name, us in rows:
        print(f"{name:45s} {us:8.3f} µs per request")


if __name__ == "__main__":
    main()
