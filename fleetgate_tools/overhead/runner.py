"""The benchmark's schedule: interleaved runs against each target, then the chunk-timing run.

Every round runs each (mode, concurrency) against every target back to back, the
targets' order rotating from round to round, so slow drifts of a shared 2-core
machine (other tenants, thermal, page cache) hit every target alike. Figures are
medians over rounds. The target's CPU is read from /proc around each run and
divided by every request the run sent (warm-up and drain included).
"""

from __future__ import annotations

import math
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from fleetgate_tools.overhead.loadgen import Job, Result
from fleetgate_tools.overhead.stack import ROOT, Target, cpu_seconds, rss_mib

MODES = ("plain", "stream")


class _LoadGenProc:
    """One load generator process: one job in, one short line out, over pipes; each result
    (every latency of the job) comes back in a file of its own."""

    def __init__(self, workdir: Path, index: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetgate_tools.overhead.loadgen"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True,
        )
        self._dir = workdir
        self._index = index
        self._jobs = 0
        self._pending: tuple[Job, Path] | None = None

    def submit(self, job: Job) -> None:
        assert self.proc.stdin is not None
        self._jobs += 1
        path = self._dir / f"result-{self._index}-{self._jobs}.json"
        job = msgspec.structs.replace(job, result_path=str(path))
        self.proc.stdin.write(msgspec.json.encode(job) + b"\n")
        self.proc.stdin.flush()
        self._pending = (job, path)

    def collect(self) -> Result:
        assert self.proc.stdout is not None and self._pending is not None
        job, path = self._pending
        self._pending = None
        # A job runs for its duration (or up to a second per counted request), plus two
        # minutes to spare; never wait forever on it.
        limit = job.warmup_s + job.duration_s + job.requests + 120.0
        ready, _, _ = select.select([self.proc.stdout], [], [], limit)
        if not ready:
            raise RuntimeError(f"the load generator said nothing for {limit:.0f} s (job: {job})")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the load generator exited")
        data = msgspec.json.decode(line)
        if "fatal" in data:
            raise RuntimeError(f"load generator: {data['fatal']}")
        raw = path.read_bytes()
        path.unlink()
        if len(raw) != data["bytes"]:
            raise RuntimeError(f"load generator result {path}: {len(raw)} bytes, expected {data['bytes']}")
        return msgspec.json.decode(raw, type=Result)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class LoadGen:
    """The load generator: `procs` processes, each running its share of a job's clients at
    once (one event loop keeps up with a 1- or 2-process gateway; several gateway processes
    on a machine with cores to spare need several), their results merged into one."""

    def __init__(self, procs: int = 1) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="fleetgate-loadgen-")
        self.procs = [_LoadGenProc(Path(self._dir.name), i) for i in range(max(1, procs))]

    def run(self, job: Job) -> Result:
        # A fixed number of requests (the timing run) stays in one process, one at a time.
        n = 1 if job.requests else min(len(self.procs), job.concurrency)
        shares = [job.concurrency // n + (i < job.concurrency % n) for i in range(n)]
        for proc, c in zip(self.procs, shares, strict=False):
            proc.submit(msgspec.structs.replace(job, concurrency=c))
        return merge([proc.collect() for proc in self.procs[:n]])

    def close(self) -> None:
        for proc in self.procs:
            proc.close()
        self._dir.cleanup()


def merge(results: list[Result]) -> Result:
    """The results of one job's processes (same window) as one."""
    if len(results) == 1:
        return results[0]
    out = Result(window_s=max(r.window_s for r in results))
    for r in results:
        out.completed += r.completed
        out.errors += r.errors
        out.first_error = out.first_error or r.first_error
        out.latencies_ms.extend(r.latencies_ms)
        out.ttfc_ms.extend(r.ttfc_ms)
        out.chunks += r.chunks
        out.total += r.total
        out.cpu_s += r.cpu_s
        out.chunk_times_ms.extend(r.chunk_times_ms)
    return out


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class Measure:
    """One run of one target: the figures the table shows."""

    rps: float
    p50: float
    p99: float
    ttfc50: float
    ttfc99: float
    chunks_s: float
    cpu_ms: float | None  # CPU ms of the target's process per request (= s per 1,000)
    errors: int
    client_cpu_ms: float

    @classmethod
    def of(cls, res: Result, cpu_s: float | None) -> Measure:
        nan = float("nan")
        return cls(
            rps=res.completed / res.window_s if res.window_s else 0.0,
            p50=pct(res.latencies_ms, 50), p99=pct(res.latencies_ms, 99),
            ttfc50=pct(res.ttfc_ms, 50) if res.ttfc_ms else nan,
            ttfc99=pct(res.ttfc_ms, 99) if res.ttfc_ms else nan,
            chunks_s=res.chunks / res.window_s if res.window_s else 0.0,
            cpu_ms=cpu_s / res.total * 1000 if cpu_s is not None and res.total else None,
            errors=res.errors,
            client_cpu_ms=res.cpu_s / res.total * 1000 if res.total else 0.0,
        )


def median_measure(runs: list[Measure]) -> Measure:
    def med(get: Callable[[Measure], float | None]) -> Any:
        values = [v for v in map(get, runs) if v is not None]
        return statistics.median(values) if values else None

    return Measure(
        rps=med(lambda m: m.rps), p50=med(lambda m: m.p50), p99=med(lambda m: m.p99),
        ttfc50=med(lambda m: m.ttfc50), ttfc99=med(lambda m: m.ttfc99),
        chunks_s=med(lambda m: m.chunks_s), cpu_ms=med(lambda m: m.cpu_ms),
        errors=sum(m.errors for m in runs), client_cpu_ms=med(lambda m: m.client_cpu_ms),
    )


@dataclass
class Plan:
    rounds: int = 3
    duration_s: float = 2.5
    warmup_s: float = 0.5
    concurrency: tuple[int, ...] = (1, 16, 64)
    modes: tuple[str, ...] = MODES
    chunks: int = 64
    timing_requests: int = 8
    timing_chunk_delay_ms: float = 10.0
    loadgen_procs: int = 1


@dataclass
class Report:
    targets: list[str]
    # (mode, concurrency, target) -> a Measure per round
    runs: dict[tuple[str, int, str], list[Measure]] = field(default_factory=dict)
    # target -> per chunk index, the median transit from the stub's write to the client (ms)
    timing: dict[str, list[float]] = field(default_factory=dict)
    rss_mib: dict[str, tuple[float, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def medians(self) -> dict[tuple[str, int, str], Measure]:
        return {key: median_measure(runs) for key, runs in self.runs.items()}


def job_for(target: Target, plan: Plan, mode: str, concurrency: int, **extra: Any) -> Job:
    fields: dict[str, Any] = {
        "urls": target.urls, "stream": mode == "stream", "concurrency": concurrency,
        "duration_s": plan.duration_s, "warmup_s": plan.warmup_s, "max_tokens": plan.chunks,
        "api_key": target.api_key, **extra,
    }
    return Job(**fields)


def measure(loadgen: LoadGen, target: Target, job: Job) -> Measure:
    before = cpu_seconds(target.pid) if target.pid else None
    res = loadgen.run(job)
    cpu = cpu_seconds(target.pid) - before if target.pid and before is not None else None
    return Measure.of(res, cpu)


def run(targets: list[Target], plan: Plan, log: Callable[[str], None]) -> Report:
    report = Report([t.name for t in targets])
    loadgen = LoadGen(plan.loadgen_procs)
    try:
        for t in targets:  # connections, caches, the first snapshot: nothing is cold later
            loadgen.run(job_for(t, plan, "stream", 4, duration_s=0.5, warmup_s=0.0))
            if t.pid:
                report.rss_mib[t.name] = (rss_mib(t.pid), 0.0)
        total = plan.rounds * len(plan.modes) * len(plan.concurrency) * len(targets)
        done = 0
        started = time.monotonic()
        for r in range(plan.rounds):
            order = targets[r % len(targets):] + targets[: r % len(targets)]
            for mode in plan.modes:
                for c in plan.concurrency:
                    for t in order:
                        m = measure(loadgen, t, job_for(t, plan, mode, c))
                        report.runs.setdefault((mode, c, t.name), []).append(m)
                        done += 1
                        cpu = f" cpu {m.cpu_ms:.3f} ms/req" if m.cpu_ms is not None else ""
                        err = f" ERRORS {m.errors}" if m.errors else ""
                        log(f"[{done}/{total} {time.monotonic() - started:.0f}s] round {r + 1} "
                            f"{mode} C={c} {t.name}: {m.rps:.0f} req/s p50 {m.p50:.2f} ms{cpu}{err}")
        if plan.timing_requests:
            report.timing = chunk_timing(loadgen, targets, plan, log)
        for t in targets:
            if t.pid:
                report.rss_mib[t.name] = (report.rss_mib[t.name][0], rss_mib(t.pid))
    finally:
        loadgen.close()
    return report


def chunk_timing(loadgen: LoadGen, targets: list[Target], plan: Plan,
                 log: Callable[[str], None]) -> dict[str, list[float]]:
    """One stream at a time with a per-chunk delay, targets alternating request by request."""
    transits: dict[str, list[list[float]]] = {t.name: [] for t in targets}
    for i in range(plan.timing_requests):
        for t in targets if i % 2 == 0 else list(reversed(targets)):
            job = job_for(t, plan, "stream", 1, requests=1, record_chunks=True,
                          chunk_delay_ms=plan.timing_chunk_delay_ms)
            res = loadgen.run(job)
            if res.errors or not res.chunk_times_ms:
                raise RuntimeError(f"chunk timing through {t.name} failed: {res.first_error}")
            transits[t.name].append(res.chunk_times_ms[0])
    log(f"chunk timing: {plan.timing_requests} streams of {plan.chunks} chunks, "
        f"{plan.timing_chunk_delay_ms:g} ms apart, per target")
    out = {}
    for name, rows in transits.items():
        n = min(len(r) for r in rows)
        out[name] = [statistics.median(r[k] for r in rows) for k in range(n)]
    return out


def soak(loadgen_target: Target, plan: Plan, seconds: float, concurrency: int,
         log: Callable[[str], None], every_s: float = 30.0) -> list[tuple[float, float, float]]:
    """Load the target for `seconds`, alternating plain and streaming; (t, rps, RSS MiB) per step."""
    assert loadgen_target.pid is not None
    loadgen = LoadGen(plan.loadgen_procs)
    samples = [(0.0, 0.0, rss_mib(loadgen_target.pid))]
    log(f"soak: RSS at start {samples[0][2]:.1f} MiB")
    t = 0.0
    try:
        step = 0
        while t < seconds:
            d = min(every_s, seconds - t)
            half = max(d / 2 - 0.25, 0.5)
            rps = 0.0
            for mode in MODES:
                job = job_for(loadgen_target, plan, mode, concurrency, duration_s=half, warmup_s=0.25)
                res = loadgen.run(job)
                rps += res.completed / half / 2
            t += d
            step += 1
            samples.append((t, rps, rss_mib(loadgen_target.pid)))
            log(f"soak {t:.0f}s: {rps:.0f} req/s, RSS {samples[-1][2]:.1f} MiB")
    finally:
        loadgen.close()
    return samples
