"""The open-loop load generator: send each request at its arrival time, stream, time it.

Requests go out at their trace time whether or not earlier ones have finished (a closed
loop would slow down with the system under test and hide its queues). A bounded aiohttp
pool caps open connections; a request waiting for a connection is already late, and its
latencies count from its arrival time. Such a request is marked (`pool_full`) and the runner
warns: a wait in the client's own pool is not the system's latency, so the default pool
(`POOL`) is far above what a run keeps open (a 256 cap once made a gateway look 3x slower
than a client that sent straight to the engines, at the same concurrency). TTFT is the time to the first chunk that carries
generated text, not to the headers or the role-only chunk.

A request with `answer_tokens` is read for that many generated tokens (content chunks), then
its stream is closed: the gateway (or engine) sees the client go and cancels the request.
Each outcome says how its answer ended (`finish`): the engine's finish_reason ("stop",
"length", ...), or "cut" where the client closed it.

The target is a gateway's URL, or a route (fleetgate_tools/bench/strategies.py) that names the
engine each request goes to directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import aiohttp
import msgspec

from fleetgate_tools.bench.engines import WorkerRef
from fleetgate_tools.bench.workloads import BenchRequest


class Outcome(msgspec.Struct, kw_only=True):
    id: int
    tag: str
    at: float = 0.0  # the request's arrival, seconds after the run started
    status: int = 0
    # "" when it succeeded; else one of ERROR_KINDS.
    error: str = ""
    # The `code` of an OpenAI-style error body ({"error": {"code": ...}}), e.g. the
    # gateway's 429 `fleet_overloaded`; "" when the body had none.
    code: str = ""
    worker: str | None = None
    route: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    out_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    message: str = ""
    # How the answer ended: the engine's finish_reason, "cut" (the client closed the
    # stream after the request's answer_tokens), or "" (no answer, or none seen).
    finish: str = ""
    # The client's pool had `pool` requests open when this one was sent: it waited for a
    # connection, and that wait is in its latencies.
    pool_full: bool = False

# Open connections the load generator allows: far above a run's concurrency (rate x E2E).
POOL = 4096


ERROR_KINDS = (
    "http_429", "engine_ctx_400", "gateway_ctx_400", "http_4xx", "http_5xx",
    "stream_error", "transport", "timeout",
)  # fmt: skip

_chunk = msgspec.json.Decoder()


def error_code(body: str) -> str:
    """The `code` of an OpenAI-style error body, "" if it is not one."""
    try:
        obj = _chunk.decode(body)
    except msgspec.DecodeError:
        return ""
    err = obj.get("error") if isinstance(obj, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return str(code) if code else ""


def classify(status: int, body: str, from_engine: bool) -> str:
    if status == 429:
        return "http_429"
    if status == 400 and any(s in body for s in ("context length", "KV cache", "context_length")):
        return "engine_ctx_400" if from_engine else "gateway_ctx_400"
    return "http_4xx" if status < 500 else "http_5xx"


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    req: BenchRequest,
    t0: float,
    headers: dict[str, str],
    out: Outcome,
    worker: str | None = None,
    answer: list[str] | None = None,
) -> Outcome:
    """Send one request and fill `out` in as it streams; the generated text is appended to
    `answer` piece by piece when one is given (a conversation's next turn carries it)."""
    hdrs = dict(headers)
    if req.session:
        hdrs["x-session-id"] = req.session
    out.worker = worker
    try:
        async with session.post(url, json=req.body(), headers=hdrs) as resp:
            out.status = resp.status
            out.worker = resp.headers.get("x-fleetgate-worker") or worker
            out.route = resp.headers.get("x-fleetgate-route")
            if resp.status != 200:
                text = await resp.text()
                out.code = error_code(text)
                out.error = classify(resp.status, text[:300], out.worker is not None)
                out.message = text[:300]
                return out
            chunks = 0
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                obj = _chunk.decode(data)
                if "error" in obj:
                    out.error, out.message = "stream_error", str(obj["error"])[:300]
                    break
                for choice in obj.get("choices") or ():
                    delta = choice.get("delta") or {}
                    piece = delta.get("content") if "delta" in choice else choice.get("text")
                    if piece and answer is not None:
                        answer.append(piece)
                    if piece or choice.get("finish_reason"):
                        chunks += 1
                        if out.ttft is None:
                            out.ttft = time.perf_counter() - t0
                    if choice.get("finish_reason"):
                        out.finish = str(choice["finish_reason"])
                usage = obj.get("usage")
                if usage:
                    out.out_tokens = int(usage.get("completion_tokens") or 0)
                    out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = int(details.get("cached_tokens") or 0)
                if req.answer_tokens and chunks >= req.answer_tokens and not out.finish:
                    # The answer is long enough: hang up (the connection is dropped, not
                    # pooled, so the other end sees the client go).
                    out.finish = "cut"
                    resp.close()
                    break
            out.out_tokens = out.out_tokens or chunks
            out.e2e = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
        out.error, out.message = "transport", repr(exc)[:300]
    return out


def targets(
    target: str | Callable[[BenchRequest], WorkerRef],
) -> Callable[[BenchRequest], tuple[str, str | None]]:
    """(chat completions URL, the worker it names or None) per request."""
    if isinstance(target, str):
        url = target.rstrip("/") + "/v1/chat/completions"
        return lambda _req: (url, None)
    route = target
    return lambda req: ((w := route(req)).url.rstrip("/") + "/v1/chat/completions", w.id)


async def run_requests(
    target: str | Callable[[BenchRequest], WorkerRef],
    requests: Sequence[BenchRequest],
    *,
    pool: int = POOL,
    drain_s: float = 10.0,
    api_key: str | None = None,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> tuple[list[Outcome], float]:
    """Send every request at its time; wait up to `drain_s` after the last arrival for the
    rest, then cancel them (counted as "timeout", their TTFT censored at the cut).
    Returns the outcomes in request order and the run's wall time."""
    where = targets(target)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=pool, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
    starts: dict[int, float] = {}
    partial: dict[int, Outcome] = {}
    tasks: dict[int, asyncio.Task[Outcome]] = {}
    done = 0

    def finished(_: asyncio.Task[Outcome]) -> None:
        nonlocal done
        done += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        begin = time.perf_counter()
        for req in requests:
            delay = begin + req.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t0 = begin + req.at
            starts[req.id] = t0
            partial[req.id] = Outcome(id=req.id, tag=req.tag, at=req.at, pool_full=len(tasks) - done >= pool)
            url, worker = where(req)
            task = asyncio.create_task(send_one(session, url, req, t0, headers, partial[req.id], worker))
            task.add_done_callback(finished)
            tasks[req.id] = task
            if on_progress:
                on_progress(len(tasks), done, len(requests))
        deadline = time.perf_counter() + drain_s
        while done < len(tasks) and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
            if on_progress:
                on_progress(len(tasks), done, len(requests))
        cut = time.perf_counter()
        outcomes = []
        for req in requests:
            task = tasks[req.id]
            if task.done():
                outcomes.append(task.result())
                continue
            task.cancel()
            cut_short = partial[req.id]
            cut_short.error, cut_short.message = "timeout", "cut at the drain deadline"
            if cut_short.ttft is None:  # censored: at least this long
                cut_short.ttft = cut - starts[req.id]
            outcomes.append(cut_short)
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        wall = cut - begin
    return outcomes, wall
