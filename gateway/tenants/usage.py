"""Usage per API key and model: daily roll-ups in Redis, and this replica's Prometheus counters.

Every request a key makes ends in a write (gateway/tenants/quota.py's settle script for a key with
limits; `UsageBuffer`, once a second, for one without) to the day's hash, `{P}:v1:usage:<YYYY-MM-DD>` (UTC), fields `<key id>\\t<model>\\t<counter>`, kept 35
days: requests, input and output tokens (the engine's counts), errors (answers >= 400) and
rate_limited (refused by a limit of the key or its team). Read back by `GET /admin/usage`,
`fleetgate usage` and the dashboard. Keys appear by id, never by secret; models as the
metrics name them (a model the fleet never served is `unknown`), so a client cannot grow
the records or the metrics by inventing names.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
import structlog
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from fleetgate.background import Outage, stop_tasks
from fleetgate.keys import Keys
from gateway.observe.cells import CounterFamily as Counter

log = structlog.get_logger("gateway.usage")

USAGE_TTL_S = 35 * 86400
COUNTERS = ("requests", "input", "output", "errors", "rate_limited")
# Names in the API's answer.
_OUT = {"requests": "requests", "input": "input_tokens", "output": "output_tokens", "errors": "errors",
        "rate_limited": "rate_limited"}
OTHER_KEY = "other"


def day_of(when: dt.datetime) -> str:
    return when.strftime("%Y-%m-%d")


class Today:
    """The UTC day as `day_of` writes it, formatted once a day rather than once a request."""

    __slots__ = ("_day", "_text")

    def __init__(self) -> None:
        self._day = -1
        self._text = ""

    def __call__(self) -> str:
        day = int(time.time() // 86400)
        if day != self._day:
            self._day, self._text = day, time.strftime("%Y-%m-%d", time.gmtime(day * 86400))
        return self._text


def days_back(n: int, today: dt.date | None = None) -> list[str]:
    """The last `n` UTC days, newest first."""
    today = today or dt.datetime.now(dt.UTC).date()
    return [(today - dt.timedelta(days=i)).isoformat() for i in range(max(1, n))]


def parse_day(value: str) -> str:
    return dt.date.fromisoformat(value).isoformat()


def fold(day: str, rows: dict[Any, Any], key: str | None = None, model: str | None = None) -> list[dict[str, Any]]:
    """One day's hash as records, one per (key, model), filtered."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for raw, value in rows.items():
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        parts = name.split("\t")
        if len(parts) != 3 or parts[2] not in _OUT:
            continue
        key_id, model_name, counter = parts
        if (key is not None and key_id != key) or (model is not None and model_name != model):
            continue
        record = out.setdefault((key_id, model_name), {"day": day, "key": key_id, "model": model_name,
                                                       **dict.fromkeys(_OUT.values(), 0)})
        record[_OUT[counter]] += int(value)
    return [out[k] for k in sorted(out)]


def totals(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    sums = dict.fromkeys(_OUT.values(), 0)
    for r in records:
        for name in sums:
            sums[name] += r[name]
    return sums


async def read_usage(redis: aioredis.Redis, keys: Keys, days: list[str], key: str | None = None,
                     model: str | None = None) -> list[dict[str, Any]]:
    async with redis.pipeline(transaction=False) as pipe:
        for day in days:
            pipe.hgetall(keys.usage(day))
        rows = await pipe.execute()
    records: list[dict[str, Any]] = []
    for day, row in zip(days, rows, strict=True):
        records += fold(day, row, key, model)
    return records


class UsageMetrics:
    """This replica's per-key counters (Prometheus sums the replicas). Labels: only the ids of
    configured keys (`known` says which); others count as `other`."""

    def __init__(self, registry: CollectorRegistry, known: Callable[[str], bool] = lambda k: True) -> None:
        self.known = known
        self._requests = Counter("fleetgate_key_requests", "Requests of an API key that reached its limits' "
                                 "check, by key id, model and whether the answer was an error.",
                                 ["key", "model", "error"], registry=registry)
        self._tokens = Counter("fleetgate_key_tokens", "Tokens an API key used (the engine's counts), by key "
                               "id, model and direction (input, output).", ["key", "model", "direction"],
                               registry=registry)
        self._limited = Counter("fleetgate_key_rate_limited", "Requests refused by a key's or its team's "
                                "limit, by key id, model and limit (requests, tokens, budget).",
                                ["key", "model", "limit"], registry=registry)

    def _key(self, key_id: str) -> str:
        return key_id if self.known(key_id) else OTHER_KEY

    def done(self, key_id: str, model: str, prompt: int, completion: int, error: bool) -> None:
        key = self._key(key_id)
        self._requests.labels(key, model, "true" if error else "false").inc()
        if prompt:
            self._tokens.labels(key, model, "input").inc(prompt)
        if completion:
            self._tokens.labels(key, model, "output").inc(completion)

    def rate_limited(self, key_id: str, model: str, limit: str) -> None:
        self._limited.labels(self._key(key_id), model, limit).inc()


class UsageBuffer:
    """Usage of keys without limits (nothing waits on it): summed in memory and written once a
    `flush_s` in one pipeline, instead of a Redis call per request. Counts a write could not
    make stay for the next one; at most `flush_s` of them are lost if the gateway dies."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, flush_s: float = 1.0) -> None:
        self.redis = redis
        self.keys = keys
        self.flush_s = flush_s
        self._counts: dict[tuple[str, str], int] = {}
        self._task: asyncio.Task[None] | None = None
        # One warning per outage; usage flushes quietly again once Redis is back.
        self._outage = Outage(log, "gateway.usage_unavailable")

    def add(self, day: str, prefix: str, requests: int, prompt: int, completion: int, errors: int) -> None:
        counts = self._counts
        for name, n in (("requests", requests), ("input", prompt), ("output", completion), ("errors", errors)):
            if n:
                cell = (day, prefix + name)
                counts[cell] = counts.get(cell, 0) + n

    async def flush(self) -> None:
        if not self._counts:
            return
        counts, self._counts = self._counts, {}
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for (day, field), n in counts.items():
                    pipe.hincrby(self.keys.usage(day), field, n)
                for day in {day for day, _ in counts}:
                    pipe.expire(self.keys.usage(day), USAGE_TTL_S)
                await pipe.execute()
            self._outage.ok()
        except (RedisError, OSError) as exc:
            self._outage.failed(exc, pending=len(counts))
            for cell, n in counts.items():
                self._counts[cell] = self._counts.get(cell, 0) + n

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="usage-flush")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def stop(self) -> None:
        await stop_tasks(self._task)
        await self.flush()
