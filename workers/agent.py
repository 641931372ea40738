"""The worker agent: one engine, from start to deregistration.

    launch engine (own process group) -> register `starting` -> wait for /health
    -> read /v1/models -> one warm-up request -> register `ready`
    -> every second: scrape /metrics, heartbeat (TTL) with the load
    -> SIGTERM: `draining`, wait until the engine is idle (or the grace period ends),
       stop the engine's whole group, deregister.

If the engine dies, the agent deregisters and exits non-zero. If Redis loses the
record (a restart), the next heartbeat notices and registers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from typing import IO

import httpx
import msgspec
import structlog

from fleetgate.registry import (
    DEFAULT_HEARTBEAT_TTL_S,
    DEFAULT_PREFIX,
    HeartbeatReply,
    Registry,
    connect,
)
from fleetgate.schema import Load, WorkerInfo, WorkerState
from workers.engines import Engine, EngineSpec
from workers.engines.base import pooling
from workers.engines.sim import card_speed

log = structlog.get_logger("workers.agent")


class AgentOptions(msgspec.Struct, kw_only=True):
    worker_id: str
    engine: str
    spec: EngineSpec
    # False for `--engine external`: the engine is someone else's; attach, never start or stop.
    managed: bool = True
    url: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = DEFAULT_PREFIX
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = DEFAULT_HEARTBEAT_TTL_S
    health_timeout_s: float = 900.0
    drain_grace_s: float = 60.0
    warmup: bool = True
    engine_log: str | None = None
    # An external engine that fails this many heartbeats in a row counts as dead.
    max_missed_scrapes: int = 5
    # How often the engine's model list is re-read (adapters loaded or unloaded at runtime).
    rediscover_s: float = 5.0

    @property
    def base_url(self) -> str:
        return self.url or f"http://{self.spec.host}:{self.spec.port}"


class EngineDied(Exception):
    pass


class RemovedByOperator(Exception):
    pass


class Agent:
    def __init__(self, options: AgentOptions, engine: Engine) -> None:
        self.opts = options
        self.engine = engine
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = asyncio.Event()
        self.state: WorkerState = "starting"
        self.info: WorkerInfo | None = None
        self.load = Load()
        self._log_file: IO[bytes] | None = None
        self._discovered_at = time.monotonic()
        self.log = log.bind(worker=options.worker_id, engine=options.engine)

    # -- lifecycle --------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        redis = connect(self.opts.redis_url)
        self.registry = Registry(
            redis, self.opts.redis_prefix, self.opts.heartbeat_ttl_s,
            secret=os.environ.get("FLEETGATE_REGISTRATION_SECRET", ""),
        )
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0))
        code = 0
        try:
            if self.opts.managed:
                await self._launch()
            self.info = self._initial_info()
            await self._register_quietly("starting")
            if not await self._wait_healthy():
                return 0 if self.stopping.is_set() else 1
            self.info = await self._discover()
            if self.opts.warmup:
                await self._warmup()
            await self._read_kv_cache()
            self.load = await self._scrape() or Load(ts=time.time())
            self.state = "ready"
            await self.registry.register(self.info, "ready", self.load)
            self.log.info("agent.ready", url=self.info.url, model=self.info.model,
                          adapters=list(self.info.adapters), max_model_len=self.info.max_model_len,
                          kv_tokens=self.info.kv_tokens)
            await self._heartbeat_until_stopped()
            await self._drain()
        except EngineDied as exc:
            self.log.error("agent.engine_died", reason=str(exc))
            code = 1
        except RemovedByOperator:
            self.log.info("agent.removed", reason="an operator removed this worker; stopping")
        finally:
            with contextlib.suppress(Exception):
                await self.registry.deregister(self.opts.worker_id)
                self.log.info("agent.deregistered")
            await self._stop_engine()
            await self.http.aclose()
            await redis.aclose()
            if self._log_file:
                self._log_file.close()
        return code

    def _on_signal(self, sig: signal.Signals) -> None:
        self.log.info("agent.signal", signal=sig.name)
        if self.stopping.is_set() and self.proc is not None and self.proc.returncode is None:
            # A second signal: stop waiting for the drain.
            self._kill_group(signal.SIGTERM)
        self.stopping.set()

    # -- engine process ---------------------------------------------------------

    async def _launch(self) -> None:
        argv = self.engine.command(self.opts.spec)
        env = {**os.environ, **self.engine.environment(self.opts.spec)}
        out: int | IO[bytes] | None = None
        if self.opts.engine_log:
            self._log_file = open(self.opts.engine_log, "ab")  # noqa: ASYNC230 - once, at start
            out = self._log_file
        self.log.info("agent.engine_starting", argv=argv)
        self.proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=out, stderr=asyncio.subprocess.STDOUT if out else None,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent,
        )

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.returncode is not None:
            raise EngineDied(f"engine exited with code {self.proc.returncode}")

    def _kill_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    async def _stop_engine(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self._kill_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.log.warning("agent.engine_kill", reason="did not stop within 15 s of SIGTERM")
        # Also stop helpers the engine left in its group (vLLM's engine core, say).
        self._kill_group(signal.SIGKILL)
        with contextlib.suppress(Exception):
            await self.proc.wait()
        self.log.info("agent.engine_stopped", code=self.proc.returncode)

    # -- talking to the engine ----------------------------------------------------

    def _initial_info(self) -> WorkerInfo:
        spec = self.opts.spec
        return WorkerInfo(
            id=self.opts.worker_id,
            url=self.opts.base_url,
            engine=self.opts.engine if self.opts.managed else f"external:{self.opts.engine}",
            model=spec.served_name,
            adapters=tuple(spec.adapters),
            max_model_len=spec.max_model_len,
            gpu=spec.gpu,
            host=socket.gethostname(),
            capacity=self.engine.capacity(spec),
            speed=card_speed(spec),
            runtime_lora=self.engine.runtime_lora,
            max_loras=self.engine.max_loras(spec),
            reports_load=self.engine.reports_load,
            pooling=pooling(spec),
            agent_pid=os.getpid(),
            started_at=time.time(),
        )

    async def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.opts.health_timeout_s
        url = self.opts.base_url + self.engine.health_path
        last_beat = 0.0
        while time.monotonic() < deadline:
            if self.stopping.is_set():
                return False
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get(url, timeout=2.0)).status_code == 200:
                    return True
            if time.monotonic() - last_beat >= self.opts.heartbeat_interval_s:
                last_beat = time.monotonic()
                if await self._beat(Load(ts=time.time())) == "missing":
                    await self._register_quietly("starting")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.25)
        raise EngineDied(f"no healthy answer from {url} within {self.opts.health_timeout_s:.0f} s")

    async def _discover(self) -> WorkerInfo:
        """Read what the engine really serves: its model name, adapters and context length."""
        assert self.info is not None
        try:
            resp = await self.http.get(self.opts.base_url + "/v1/models")
            entries = resp.json().get("data", []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            entries = []
        ids = [e.get("id") for e in entries if isinstance(e, dict) and e.get("id")]
        base = next((e for e in entries if isinstance(e, dict) and not e.get("parent")), None)
        model = self.opts.spec.served_name
        if base is not None and model not in ids:
            model = base["id"]
        if not ids:  # the engine did not answer: keep what we knew
            return self.info
        adapters = tuple(i for i in ids if i != model)
        max_len = self.info.max_model_len
        if base is not None and isinstance(base.get("max_model_len"), int):
            max_len = base["max_model_len"]
        return msgspec.structs.replace(self.info, model=model, adapters=adapters, max_model_len=max_len)

    async def _warmup(self) -> None:
        assert self.info is not None
        started = time.monotonic()
        body: dict[str, object]
        if self.info.pooling:  # an embedding model generates nothing
            path, body = "/v1/embeddings", {"model": self.info.model, "input": "Hello"}
        else:
            path, body = "/v1/completions", {"model": self.info.model, "prompt": "Hello", "max_tokens": 1}
        try:
            resp = await self.http.post(self.opts.base_url + path, json=body, timeout=120)
            self.log.info("agent.warmup", status=resp.status_code,
                          ms=round((time.monotonic() - started) * 1000, 1))
        except httpx.HTTPError as exc:
            self.log.warning("agent.warmup_failed", error=repr(exc))

    async def _read_kv_cache(self) -> None:
        """Register the KV cache's size, as the engine's metrics state it (0 when they do not)."""
        assert self.info is not None
        if self.engine.metrics_path is None:
            return
        try:
            resp = await self.http.get(self.opts.base_url + self.engine.metrics_path, timeout=3)
            resp.raise_for_status()
            kv = self.engine.parse_kv_cache(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.log.warning("agent.kv_cache_unknown", error=repr(exc))
            return
        self.info = msgspec.structs.replace(
            self.info, kv_tokens=kv.tokens, block_size=kv.block_size or self.info.block_size
        )
        self.log.info("agent.kv_cache", tokens=kv.tokens, block_size=kv.block_size)

    async def _scrape(self) -> Load | None:
        path = self.engine.metrics_path
        if path is None or not self.engine.reports_load:
            # No metrics: check liveness through the health path instead.
            try:
                ok = (await self.http.get(self.opts.base_url + self.engine.health_path, timeout=3)).status_code == 200
            except httpx.HTTPError:
                ok = False
            return Load(ts=time.time()) if ok else None
        try:
            resp = await self.http.get(self.opts.base_url + path, timeout=3)
            resp.raise_for_status()
            return msgspec.structs.replace(self.engine.parse_metrics(resp.text), ts=time.time())
        except (httpx.HTTPError, ValueError) as exc:
            self.log.warning("agent.scrape_failed", error=repr(exc))
            return None

    # -- registry -----------------------------------------------------------------

    async def _register_quietly(self, state: WorkerState) -> None:
        assert self.info is not None
        try:
            await self.registry.register(self.info, state, self.load)
        except Exception as exc:  # Redis down: keep the engine, retry on the next beat
            self.log.warning("agent.registry_unreachable", error=repr(exc))

    async def _beat(self, load: Load) -> HeartbeatReply:
        try:
            return await self.registry.heartbeat(self.opts.worker_id, load)
        except Exception as exc:
            self.log.warning("agent.registry_unreachable", error=repr(exc))
            return "ok"  # nothing to re-register into while Redis is away

    async def _heartbeat_until_stopped(self) -> None:
        missed = 0
        while not self.stopping.is_set():
            await self._tick()
            if self.load.ts and time.time() - self.load.ts > self.opts.heartbeat_interval_s * 1.5:
                missed += 1
                if not self.opts.managed and missed >= self.opts.max_missed_scrapes:
                    raise EngineDied(f"{self.opts.base_url} failed {missed} scrapes in a row")
            else:
                missed = 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.opts.heartbeat_interval_s)

    async def _tick(self) -> None:
        self._check_alive()
        load = await self._scrape()
        self._check_alive()
        if load is not None:
            self.load = load
        if self.state == "ready" and time.monotonic() - self._discovered_at >= self.opts.rediscover_s:
            await self._rediscover()
        reply = await self._beat(self.load)
        if reply == "stop" and not self.stopping.is_set():
            self.log.info("agent.stop_requested", reason="an operator drained this worker with stop=true")
            self.stopping.set()
        elif reply == "missing":
            if await self.registry.was_removed(self.opts.worker_id):
                raise RemovedByOperator
            self.log.warning("agent.reregister", reason="record missing in Redis")
            await self._register_quietly(self.state)

    async def _rediscover(self) -> None:
        """Adapters can be loaded and unloaded at runtime (by a gateway, or by hand): keep the
        registry's list in step with what the engine really serves."""
        assert self.info is not None
        self._discovered_at = time.monotonic()
        fresh = await self._discover()
        if set(fresh.adapters) != set(self.info.adapters) and fresh.model == self.info.model:
            self.log.info("agent.adapters_changed", adapters=list(fresh.adapters))
            self.info = fresh
            with contextlib.suppress(Exception):
                await self.registry.update_info(fresh)

    async def _drain(self) -> None:
        """Stop new work, then wait until no gateway has a request in flight here and the
        engine has nothing running or queued (or the grace period ends)."""
        self.state = "draining"
        with contextlib.suppress(Exception):
            await self.registry.set_state(self.opts.worker_id, "draining")
        self.log.info("agent.draining", grace_s=self.opts.drain_grace_s)
        started = time.monotonic()
        deadline = started + self.opts.drain_grace_s
        idle_checks = 0
        inflight = 0
        # Gateways publish their in-flight counts every ~100 ms: insist on two idle checks,
        # at least a second after the drain began, so nothing still on the wire is missed.
        while time.monotonic() < deadline:
            try:
                await self._tick()
            except EngineDied:
                return
            try:
                inflight = (await self.registry.read_inflight()).get(self.opts.worker_id, 0)
            except Exception:  # Redis away: judge by the engine alone
                inflight = 0
            busy = self.load.running + self.load.waiting + inflight
            idle_checks = idle_checks + 1 if busy == 0 else 0
            if idle_checks >= 2 and time.monotonic() - started >= 1.0:
                self.log.info("agent.drained", s=round(time.monotonic() - started, 2))
                return
            await asyncio.sleep(min(0.5, self.opts.heartbeat_interval_s))
        self.log.warning("agent.drain_timeout", running=self.load.running, waiting=self.load.waiting,
                         inflight=inflight)


def die_with_parent() -> None:
    """In the engine's child process: get SIGTERM if the agent dies (Linux), so a crashed
    agent never leaves an engine holding a GPU that nobody tracks."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def default_worker_id(engine: str, port: int, gpu: str = "") -> str:
    host = socket.gethostname().split(".")[0]
    gpu_part = f"-gpu{gpu.replace(',', '_')}" if gpu else ""
    return f"{host}{gpu_part}-{engine}-{port}"


def run_agent(options: AgentOptions, engine: Engine) -> int:
    return asyncio.run(Agent(options, engine).run())


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `python -m workers`")
