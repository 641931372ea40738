"""The agent's read-only calls to its engine: health, metrics, model list, KV cache size.

Every call has a short timeout, so a hung engine (SIGSTOP'd, deadlocked, swapping) never
holds up the heartbeat. Failed probes are counted: after `unhealthy_after` in a row the
engine is unhealthy and the agent says so in its heartbeat (the gateway stops routing to
it); one probe that passes makes it healthy again.

A probe fails when the engine does not answer in time, refuses the connection, or
answers 5xx. A metrics page it cannot parse, while /health answers, is a parser
problem, not a sick engine: logged, not counted.

Each scrape also reads the engine's work counters from the same page (`work`), which the
agent's speed measurement takes (`workers/speedometer.py`).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import msgspec

from fleetgate.schema import Load, WorkerInfo
from workers.engines import Engine
from workers.engines.base import EngineWork, KvCache


class EngineProbe:
    def __init__(
        self, http: httpx.AsyncClient, base_url: str, engine: Engine, log: Any,
        timeout_s: float = 1.0, unhealthy_after: int = 3,
    ) -> None:
        self.http = http
        self.base_url = base_url
        self.engine = engine
        self.log = log
        self.timeout_s = timeout_s
        self.unhealthy_after = max(1, unhealthy_after)
        self.failures = 0
        self.last_error = ""
        self._failing_since = 0.0
        # The work counters of the last scrape that read them; None when it did not.
        self.work: EngineWork | None = None

    @property
    def unhealthy(self) -> str:
        """Why the engine counts as unhealthy; "" while it is healthy."""
        if self.failures < self.unhealthy_after:
            return ""
        return f"{self.failures} probes failed in a row: {self.last_error}"

    @property
    def failing_for_s(self) -> float:
        """Seconds since the first of the failures in a row (0 while probes pass)."""
        return time.monotonic() - self._failing_since if self.failures else 0.0

    async def get(self, path: str, timeout_s: float | None = None) -> httpx.Response:
        return await self.http.get(self.base_url + path, timeout=timeout_s or self.timeout_s)

    async def healthy_once(self, timeout_s: float = 2.0) -> bool:
        """One /health call, uncounted (for waiting on a starting engine)."""
        try:
            return (await self.get(self.engine.health_path, timeout_s)).status_code == 200
        except httpx.HTTPError:
            return False

    async def scrape(self) -> Load | None:
        """The engine's load (a health check for engines without metrics); None when the probe
        failed. Counts failures; logs when the engine turns unhealthy and when it recovers."""
        try:
            load = await self._scrape()
        except (httpx.HTTPError, _Refused) as exc:
            self._failed(exc)
            return None
        if self.failures >= self.unhealthy_after:
            self.log.info("agent.engine_recovered", after_s=round(time.monotonic() - self._failing_since, 2))
        self.failures = 0
        self.last_error = ""
        return load

    async def _scrape(self) -> Load | None:
        self.work = None
        path = self.engine.metrics_path
        if path is None or not self.engine.reports_load:
            resp = await self.get(self.engine.health_path)
            if resp.status_code != 200:
                raise _Refused(f"{self.engine.health_path} answered {resp.status_code}")
            return Load(ts=time.time())
        resp = await self.get(path)
        if resp.status_code >= 500:
            raise _Refused(f"{path} answered {resp.status_code}")
        try:
            resp.raise_for_status()
            load = msgspec.structs.replace(self.engine.parse_metrics(resp.text), ts=time.time())
            self.work = self.engine.parse_work(resp.text)
            return load
        except (httpx.HTTPStatusError, ValueError) as exc:
            # The engine answers, its metrics do not parse: not a sick engine.
            self.log.warning("agent.scrape_failed", error=repr(exc))
            return Load(ts=time.time())

    def _failed(self, exc: Exception) -> None:
        if self.failures == 0:
            self._failing_since = time.monotonic()
        self.failures += 1
        self.last_error = str(exc) or type(exc).__name__
        if self.failures == self.unhealthy_after:
            self.log.warning("agent.engine_unhealthy", failures=self.failures, error=self.last_error,
                             timeout_s=self.timeout_s)
        elif self.failures < self.unhealthy_after:
            self.log.warning("agent.probe_failed", failures=self.failures, error=self.last_error)

    async def kv_cache(self) -> KvCache:
        """The KV cache's size as the engine's metrics state it (KvCache() when they do not)."""
        if self.engine.metrics_path is None:
            return KvCache()
        try:
            resp = await self.get(self.engine.metrics_path, timeout_s=max(3.0, self.timeout_s))
            resp.raise_for_status()
            return self.engine.parse_kv_cache(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.log.warning("agent.kv_cache_unknown", error=repr(exc))
            return KvCache()

    async def discover(self, info: WorkerInfo, served_name: str, timeout_s: float = 10.0) -> WorkerInfo:
        """`info` with what the engine really serves: its model name, adapters and context
        length from /v1/models; unchanged when the engine does not answer."""
        try:
            resp = await self.get("/v1/models", timeout_s)
            entries = resp.json().get("data", []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError):
            entries = []
        ids = [e.get("id") for e in entries if isinstance(e, dict) and e.get("id")]
        if not ids:
            return info
        base = next((e for e in entries if isinstance(e, dict) and not e.get("parent")), None)
        model = served_name
        if base is not None and model not in ids:
            model = base["id"]
        adapters = tuple(i for i in ids if i != model)
        max_len = info.max_model_len
        if base is not None and isinstance(base.get("max_model_len"), int):
            max_len = base["max_model_len"]
        return msgspec.structs.replace(info, model=model, adapters=adapters, max_model_len=max_len)


class _Refused(Exception):
    """The engine answered, but as a sick one does (5xx, or a failing health path)."""
