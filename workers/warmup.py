"""The first requests an agent sends its engine: the warm-up, and the speed probe.

A failed warm-up is a failed start. Each step is retried a few times (bounded in attempts
and in time, one log event per retry); when the attempts are spent, `StartFailed` says
why, and the agent exits non-zero with the engine's last log lines, never registering
the worker ready.

The speed probe (only when neither the card's profile nor `--speed` gives the speed, as
for an `--engine external`): one batch of requests with fixed sizes (`ignore_eos`, each
prompt unique so that no prefix cache shortens it), timed from the first byte sent to the
last reply, against what the reference profile predicts for the same token counts
(`workers/speed.py`). The counts are the engine's own (`usage`), not estimates.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec
import structlog

from fleetgate.schema import WorkerInfo
from workers.speed import measured_speed, reference_seconds

T = TypeVar("T")

# The workload `relative_speed` compares cards by: 16 requests of ~1000 + 100 tokens.
PROBE_BATCH = 16
PROBE_PROMPT_TOKENS = 1000
PROBE_OUTPUT_TOKENS = 100
# Short, common words: about one token each in any tokenizer (and 4-5 bytes in the simulator's).
_WORDS = ("the", "time", "data", "file", "name", "value", "list", "line", "text", "code", "part",
          "test", "case", "type", "size", "word", "point", "number", "result", "order")


class StartFailed(Exception):
    """The engine answered its health check but failed the warm-up or the speed probe."""


async def retrying(
    what: str, step: Callable[[], Awaitable[T]], log: structlog.typing.FilteringBoundLogger,
    attempts: int = 3, backoff_s: float = 1.0, budget_s: float = 600.0,
) -> T:
    """`step()` until it returns, at most `attempts` times and `budget_s` seconds; waits
    backoff_s x 2^n (with jitter) between attempts. Retries only StartFailed."""
    deadline = time.monotonic() + budget_s
    for attempt in range(1, attempts + 1):
        try:
            return await step()
        except StartFailed as exc:
            wait = backoff_s * 2 ** (attempt - 1) * random.uniform(0.8, 1.2)
            if attempt == attempts or time.monotonic() + wait > deadline:
                raise StartFailed(f"{what} failed {attempt} times; last: {exc}") from None
            log.warning("agent.start_retry", step=what, attempt=attempt, error=str(exc), wait_s=round(wait, 2))
            await asyncio.sleep(wait)
    raise AssertionError("unreachable")


async def _post(http: httpx.AsyncClient, url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    try:
        resp = await http.post(url, json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise StartFailed(f"POST {url}: {exc!r}") from None
    if resp.status_code != 200:
        raise StartFailed(f"POST {url}: {resp.status_code} {resp.text[:300]}")
    try:
        data = resp.json()
    except ValueError:
        raise StartFailed(f"POST {url}: 200 without a JSON body") from None
    if not isinstance(data, dict):
        raise StartFailed(f"POST {url}: 200 with {type(data).__name__}, not an object")
    return data


async def warm_up(http: httpx.AsyncClient, base_url: str, info: WorkerInfo, timeout_s: float = 120.0) -> float:
    """One tiny request through the engine's serving path; its time in ms."""
    started = time.monotonic()
    if info.pooling:  # an embedding model generates nothing
        await _post(http, base_url + "/v1/embeddings", {"model": info.model, "input": "Hello"}, timeout_s)
    else:
        body = {"model": info.model, "prompt": "Hello", "max_tokens": 1}
        data = await _post(http, base_url + "/v1/completions", body, timeout_s)
        if not data.get("choices"):
            raise StartFailed(f"the warm-up completion has no choices: {str(data)[:300]}")
    return round((time.monotonic() - started) * 1000, 1)


def probe_shape(info: WorkerInfo) -> tuple[int, int, int]:
    """(requests, prompt words, output tokens) for the probe: the reference workload, cut to
    the engine's batch and context (a word is at most ~3 tokens even in a small tokenizer)."""
    batch = max(1, min(PROBE_BATCH, info.capacity))
    output = max(8, min(PROBE_OUTPUT_TOKENS, info.max_model_len // 4))
    words = max(8, min(PROBE_PROMPT_TOKENS, (info.max_model_len - output) // 3))
    return batch, words, output


async def probe_speed(
    http: httpx.AsyncClient, base_url: str, info: WorkerInfo, timeout_s: float = 300.0
) -> tuple[float, dict[str, float]]:
    """The engine's speed relative to the reference card, and the figures it came from."""
    batch, words, output = probe_shape(info)

    def body() -> dict[str, Any]:
        rng = random.Random()
        prompt = uuid.uuid4().hex + " " + " ".join(rng.choice(_WORDS) for _ in range(words))
        return {"model": info.model, "prompt": prompt, "max_tokens": output, "ignore_eos": True,
                "temperature": 0}

    bodies = [body() for _ in range(batch)]
    url = base_url + "/v1/completions"
    started = time.monotonic()
    replies = await asyncio.gather(*(_post(http, url, b, timeout_s) for b in bodies))
    seconds = time.monotonic() - started
    prompts, outputs = [], []
    for reply in replies:
        usage = reply.get("usage") or {}
        if not isinstance(usage.get("prompt_tokens"), int) or not isinstance(usage.get("completion_tokens"), int):
            raise StartFailed(f"the speed probe's reply has no token usage: {str(reply)[:300]}")
        prompts.append(usage["prompt_tokens"])
        outputs.append(usage["completion_tokens"])
    speed = measured_speed(seconds, prompts, outputs)
    figures = {
        "requests": batch, "prompt_tokens": sum(prompts), "output_tokens": sum(outputs),
        "measured_s": round(seconds, 3), "reference_s": round(reference_seconds(prompts, outputs), 3),
    }
    return speed, figures


def log_tail(path: str | None, lines: int = 20) -> list[str]:
    """The last `lines` lines of the engine's log file ([] when there is none)."""
    if not path or not Path(path).exists():
        return []
    with open(path, "rb") as f:
        return [line.decode(errors="replace").rstrip() for line in deque(f, maxlen=lines)]


def report_failed_start(log: structlog.typing.FilteringBoundLogger, engine_log: str | None, exc: StartFailed) -> None:
    """Say why the start failed, with the engine's last log lines (on stderr too)."""
    tail = log_tail(engine_log)
    log.error("agent.start_failed", reason=str(exc), engine_log=engine_log, engine_log_tail=tail)
    if tail:
        print(f"--- the last {len(tail)} lines of {engine_log} ---", *tail,
              "--- end of the engine's log ---", sep="\n", file=sys.stderr, flush=True)


async def start_speed(
    http: httpx.AsyncClient, base: str, info: WorkerInfo, *, warmup: bool, attempts: int,
    log: structlog.typing.FilteringBoundLogger,
) -> WorkerInfo:
    """The warm-up request (unless `warmup` is off), then the speed probe when nothing else
    gives the speed: `info` with the speed it will register."""
    if warmup:
        ms = await retrying("warm-up", lambda: warm_up(http, base, info), log, attempts)
        # warm_up raises unless the engine answered 200 on that route.
        route = "/v1/embeddings" if info.pooling else "/v1/completions"
        log.info("agent.warmup", ms=ms, route=route, status=200)
    if info.speed_source:
        log.info("agent.speed", speed=info.speed, source=info.speed_source)
        return info
    if not warmup or info.pooling:
        why = "--no-warmup" if not warmup else "an embedding model generates nothing to time"
        log.warning("agent.speed_assumed", speed=1.0, reason=f"not measured: {why}",
                    hint="declare the card's speed with --speed X (an H100 with a 7B model is 1.0)")
        return msgspec.structs.replace(info, speed=1.0, speed_source="assumed")
    speed, figures = await retrying("speed probe", lambda: probe_speed(http, base, info), log, attempts)
    log.info("agent.speed", speed=speed, source="measured", **figures)
    return msgspec.structs.replace(info, speed=speed, speed_source="measured")
