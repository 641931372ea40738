"""The closed-loop load generator, in a process of its own: `python -m fleetgate_tools.overhead.loadgen`.

It reads one job per line on stdin (JSON, see `Job`) and answers each with one line
of JSON on stdout: the `Result`, or, when the job names a `result_path`, the result
goes to that file and the line only says so (a result holds every latency, a megabyte
or more: a file keeps the pipe to the orchestrator down to a few bytes a job).

A job runs `concurrency` clients, each sending its next request as soon as the last
one finished, over one aiohttp session whose pool holds `concurrency` connections,
round-robin over `urls`. Requests finishing inside the
measured window (after `warmup_s`, for `duration_s`) make the figures; `total` counts
every request of the job, for CPU per request of the process under test.

Its own process and event loop keep its CPU apart from the gateway's; uvloop keeps
that CPU small, since on a 2-core machine it competes with the system under test.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import aiohttp
import msgspec

PROMPTS = 64


class Job(msgspec.Struct, kw_only=True):
    urls: list[str]
    path: str = "/v1/chat/completions"
    model: str = "stub"
    stream: bool = False
    concurrency: int = 1
    duration_s: float = 3.0
    warmup_s: float = 0.5
    # Run exactly this many requests instead (duration ignored): the chunk-timing run.
    requests: int = 0
    max_tokens: int = 64
    api_key: str = ""
    # Forwarded in the body to the stub (fleetgate_tools.overhead.stub).
    chunk_delay_ms: float | None = None
    delay_ms: float | None = None
    record_chunks: bool = False
    # Write the Result to this file and answer with a short line.
    result_path: str = ""


class Result(msgspec.Struct, kw_only=True):
    completed: int = 0
    errors: int = 0
    first_error: str = ""
    window_s: float = 0.0
    latencies_ms: list[float] = msgspec.field(default_factory=list)
    ttfc_ms: list[float] = msgspec.field(default_factory=list)
    chunks: int = 0
    total: int = 0
    cpu_s: float = 0.0
    # record_chunks: per request, each stamped event's transit (ms from the stub's write to
    # its arrival here; both clocks are the host's CLOCK_MONOTONIC).
    chunk_times_ms: list[list[float]] = msgspec.field(default_factory=list)


def bodies(job: Job) -> list[bytes]:
    """A few distinct prompts, so affinity routing spreads them like real traffic."""
    out = []
    for i in range(PROMPTS):
        body: dict[str, object] = {"model": job.model, "max_tokens": job.max_tokens, "stream": job.stream}
        text = f"Question {i}: what is the capital of country number {i * 7}?"
        if job.path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if job.chunk_delay_ms is not None:
            body["stub_chunk_delay_ms"] = job.chunk_delay_ms
        if job.delay_ms is not None:
            body["stub_delay_ms"] = job.delay_ms
        out.append(msgspec.json.encode(body))
    return out


_STAMP = b'"stub_sent":'


def _transits(buffer: bytes, now: float) -> list[float]:
    """Transit (ms) of each complete stamped event in `buffer`."""
    out = []
    end = buffer.rfind(b"\n\n")
    at = buffer.find(_STAMP)
    while 0 <= at < end:
        start = at + len(_STAMP)
        stop = buffer.index(b",", start)
        out.append((now - float(buffer[start:stop])) * 1000)
        at = buffer.find(_STAMP, stop)
    return out


async def run_job(job: Job) -> Result:
    res = Result()
    cpu0 = os.times()
    payloads = bodies(job)
    urls = [u.rstrip("/") + job.path for u in job.urls]
    headers = {"content-type": "application/json"}
    if job.api_key:
        headers["authorization"] = f"Bearer {job.api_key}"
    connector = aiohttp.TCPConnector(limit=job.concurrency, limit_per_host=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=120)
    counter = 0
    started = time.perf_counter()
    measure_from = started + (0.0 if job.requests else job.warmup_s)
    end = measure_from + job.duration_s
    remaining = job.requests

    def next_index() -> int | None:
        nonlocal counter, remaining
        if job.requests:
            if remaining <= 0:
                return None
            remaining -= 1
        elif time.perf_counter() >= end:
            return None
        counter += 1
        return counter

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        t0 = time.perf_counter()
        first = 0.0
        events = 0
        arrivals: list[float] = []
        async with session.post(urls[i % len(urls)], data=payloads[i % PROMPTS], headers=headers) as resp:
            if job.stream:
                tail = buffer = b""
                async for data in resp.content.iter_any():
                    now = time.perf_counter()
                    if not first:
                        first = now
                    # Events end with a blank line, which may straddle two reads.
                    n = (tail + data[:1]).count(b"\n\n") + data.count(b"\n\n")
                    tail = data[-1:]
                    events += n
                    if job.record_chunks:
                        buffer += data
                        arrivals.extend(_transits(buffer, time.monotonic()))
                        buffer = buffer[buffer.rfind(b"\n\n") + 2:] if n else buffer
            else:
                await resp.read()
            status = resp.status
        t1 = time.perf_counter()
        res.total += 1
        if status != 200:
            res.errors += 1
            res.first_error = res.first_error or f"HTTP {status}"
            return
        if t0 >= measure_from and (job.requests or t1 <= end):
            res.completed += 1
            res.latencies_ms.append((t1 - t0) * 1000)
            if job.stream:
                res.ttfc_ms.append((first - t0) * 1000)
                res.chunks += max(events - 1, 0)  # the [DONE] event is no chunk
                if job.record_chunks:
                    res.chunk_times_ms.append(arrivals)

    async def client(session: aiohttp.ClientSession) -> None:
        while (i := next_index()) is not None:
            try:
                await one(session, i)
            except (aiohttp.ClientError, TimeoutError) as exc:
                res.total += 1
                res.errors += 1
                res.first_error = res.first_error or repr(exc)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(job.concurrency)))
    res.window_s = (time.perf_counter() - started) if job.requests else job.duration_s
    cpu1 = os.times()
    res.cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return res


def _run(job: Job) -> Result:
    try:
        import uvloop

        return uvloop.run(run_job(job))
    except ImportError:
        return asyncio.run(run_job(job))


def main() -> None:
    encode = msgspec.json.encode
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            job = msgspec.json.decode(line, type=Job)
            result = encode(_run(job))
            if job.result_path:
                with open(job.result_path, "wb") as fh:
                    fh.write(result)
                result = encode({"result_path": job.result_path, "bytes": len(result)})
            sys.stdout.buffer.write(result + b"\n")
        except Exception as exc:  # the orchestrator reports it; the process stays up
            sys.stdout.write(json.dumps({"fatal": repr(exc)}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
