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
    cpu0 = os.times()
    run = _Run(job)
    connector = aiohttp.TCPConnector(limit=job.concurrency, limit_per_host=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=120)
    run.start()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(run.client(session) for _ in range(job.concurrency)))
    res = run.res
    res.window_s = (time.perf_counter() - run.started) if job.requests else job.duration_s
    cpu1 = os.times()
    res.cpu_s = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return res


class _Stream:
    """What a client read of one streamed answer: when its first bytes came, how many events,
    and (record_chunks) each stamped event's transit."""

    __slots__ = ("arrivals", "buffer", "events", "first", "tail")

    def __init__(self) -> None:
        self.first = 0.0
        self.events = 0
        self.arrivals: list[float] = []
        self.tail = self.buffer = b""

    async def read(self, resp: aiohttp.ClientResponse, record_chunks: bool) -> None:
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            if not self.first:
                self.first = now
            # Events end with a blank line, which may straddle two reads.
            n = (self.tail + data[:1]).count(b"\n\n") + data.count(b"\n\n")
            self.tail = data[-1:]
            self.events += n
            if record_chunks:
                self.buffer += data
                self.arrivals.extend(_transits(self.buffer, time.monotonic()))
                self.buffer = self.buffer[self.buffer.rfind(b"\n\n") + 2:] if n else self.buffer


class _Run:
    """One job's clients: the requests they take in turn, and the `Result` they fill."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.res = Result()
        self.payloads = bodies(job)
        self.urls = [u.rstrip("/") + job.path for u in job.urls]
        self.headers = {"content-type": "application/json"}
        if job.api_key:
            self.headers["authorization"] = f"Bearer {job.api_key}"
        self.counter = 0
        self.remaining = job.requests
        self.started = self.measure_from = self.end = 0.0

    def start(self) -> None:
        job = self.job
        self.started = time.perf_counter()
        self.measure_from = self.started + (0.0 if job.requests else job.warmup_s)
        self.end = self.measure_from + job.duration_s

    def next_index(self) -> int | None:
        if self.job.requests:
            if self.remaining <= 0:
                return None
            self.remaining -= 1
        elif time.perf_counter() >= self.end:
            return None
        self.counter += 1
        return self.counter

    async def client(self, session: aiohttp.ClientSession) -> None:
        res = self.res
        while (i := self.next_index()) is not None:
            try:
                await self.one(session, i)
            except (aiohttp.ClientError, TimeoutError) as exc:
                res.total += 1
                res.errors += 1
                res.first_error = res.first_error or repr(exc)

    async def one(self, session: aiohttp.ClientSession, i: int) -> None:
        job = self.job
        t0 = time.perf_counter()
        stream = _Stream()
        async with session.post(self.urls[i % len(self.urls)], data=self.payloads[i % PROMPTS],
                                headers=self.headers) as resp:
            if job.stream:
                await stream.read(resp, job.record_chunks)
            else:
                await resp.read()
            status = resp.status
        self.done(t0, time.perf_counter(), status, stream)

    def done(self, t0: float, t1: float, status: int, stream: _Stream) -> None:
        job, res = self.job, self.res
        res.total += 1
        if status != 200:
            res.errors += 1
            res.first_error = res.first_error or f"HTTP {status}"
            return
        if t0 >= self.measure_from and (job.requests or t1 <= self.end):
            res.completed += 1
            res.latencies_ms.append((t1 - t0) * 1000)
            if job.stream:
                res.ttfc_ms.append((stream.first - t0) * 1000)
                res.chunks += max(stream.events - 1, 0)  # the [DONE] event is no chunk
                if job.record_chunks:
                    res.chunk_times_ms.append(stream.arrivals)


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
