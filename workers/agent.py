"""The worker agent: one engine, from start to deregistration.

    launch engine (own process group) -> register `starting` -> wait for /health
    -> read /v1/models -> warm-up (and, where no profile or --speed gives the card's
       speed, a timed probe batch) -> read the KV cache size -> register `ready`
    -> every second: probe the engine (metrics, short timeout), heartbeat (TTL) with the load
       and the speed measured from the engine's counters (workers/speedometer.py; the
       start-up figure seeds it, an operator's --speed pins it)
    -> SIGTERM: `draining`, wait until the engine is idle (or the grace period ends),
       stop the engine's whole group, deregister.

If the engine dies, the agent deregisters and exits non-zero; if the warm-up fails (after
retries), likewise, printing the engine's last log lines. A hung engine (probes time out
a few times in a row) is published unhealthy, out of routing, until a probe passes again.
If Redis loses the record (a restart, or a Sentinel failover that outlasted its TTL), the
next heartbeat notices and registers again, re-asserting an operator's drain; a worker an
operator removed never registers again. With Sentinel, each heartbeat first asks the
sentinels whether the master moved (fleetgate/sentinel.py).
If the gateways reject the record (no registration secret, or another one), the agent
learns it from the registry while starting and for a few seconds after turning ready, and
exits non-zero, stopping its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time

import httpx
import msgspec
import redis.asyncio as aioredis
import structlog

from fleetgate.registry import HeartbeatReply, Registry, connect
from fleetgate.schema import Load, WorkerInfo, WorkerState
from workers.engine_process import EngineDied, EngineProcess
from workers.engines import Engine
from workers.kv_agent import AgentKvEvents
from workers.options import AgentOptions
from workers.probes import EngineProbe
from workers.registration import (
    REJECTION_WATCH_S,
    Registration,
    Rejected,
    RemovedByOperator,
    initial_info,
)
from workers.speedometer import Speedometer
from workers.warmup import StartFailed, report_failed_start, start_speed

log = structlog.get_logger("workers.agent")

# A measured speed this far (relative) from the one last logged is logged again.
SPEED_LOG_STEP = 0.2


class Agent:
    def __init__(self, options: AgentOptions, engine: Engine) -> None:
        self.opts = options
        self.engine = engine
        self.process: EngineProcess | None = None
        # The engine's KV cache events, subscribed and published to Redis (None: it has none).
        self.kv_events: AgentKvEvents | None = None
        self.stopping = asyncio.Event()
        self.state: WorkerState = "starting"
        self.info: WorkerInfo | None = None
        self.load = Load()
        # The running speed measurement, from the warm-up on (the start-up figure seeds it).
        self.speedometer: Speedometer | None = None
        self._logged_speed = (0.0, "")
        self._published_unhealthy = False
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
        self.registration = Registration(self.registry, self.opts.worker_id, self.log)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0))
        self.probe = EngineProbe(self.http, self.opts.base_url, self.engine, self.log,
                                 self.opts.probe_timeout_s, self.opts.unhealthy_after)
        code = 0
        try:
            await self._start_engine(redis)
            if not await self._start_up():
                return 0 if self.stopping.is_set() else 1
            await self._heartbeat_until_stopped()
            await self._drain()
        except EngineDied as exc:
            self.log.error("agent.engine_died", reason=str(exc))
            code = 1
        except StartFailed as exc:
            report_failed_start(self.log, self.opts.engine_log, exc)
            code = 1
        except RemovedByOperator:
            self.log.info("agent.removed", reason="an operator removed this worker; stopping")
        except Rejected as exc:
            self._report_rejected(str(exc))
            code = 1
        finally:
            await self._close(redis)
        return code

    async def _start_engine(self, redis: aioredis.Redis) -> None:
        """Launch a managed engine (with its KV events' endpoint, where it publishes them),
        or follow an attached engine's KV events where the operator named them."""
        if self.opts.managed:
            spec = self.opts.spec
            if self.engine.publishes_kv_events(spec):
                self.kv_events = AgentKvEvents(self.opts.worker_id)
                self.kv_events.start(redis, self.opts.redis_prefix)
                spec = msgspec.structs.replace(spec, kv_events_config=self.kv_events.engine_config())
            env = {**os.environ, **self.engine.environment(spec)}
            self.process = EngineProcess(self.engine.command(spec), env, self.opts.engine_log, self.log)
            await self.process.start()
        elif self.opts.kv_events:
            self.kv_events = AgentKvEvents(
                self.opts.worker_id, attached=(self.opts.kv_events, self.opts.kv_replay, self.opts.kv_topic))
            self.kv_events.start(redis, self.opts.redis_prefix)

    async def _start_up(self) -> bool:
        """Register `starting`, wait for the engine, learn what it serves, warm it up, and
        register `ready`. False if it never answered before a stop."""
        self.info = initial_info(self.opts, self.engine)
        await self._register_quietly("starting")
        if not await self._wait_healthy():
            return False
        self.info = await self.probe.discover(self.info, self.opts.spec.served_name)
        if not self.opts.managed and self.info.runtime_lora:
            await self._check_runtime_lora()
        self.info = await start_speed(self.http, self.opts.base_url, self.info, warmup=self.opts.warmup,
                                      attempts=self.opts.warmup_attempts, log=self.log)
        self._start_speedometer()
        kv = await self.probe.kv_cache()
        if self.kv_events is not None:
            self.kv_events.note_block_size(kv.block_size)
        self.info = msgspec.structs.replace(
            self.info, kv_tokens=kv.tokens, block_size=kv.block_size or self.info.block_size
        )
        self.load = self._with_slots(self._with_speed(await self.probe.scrape() or Load(ts=time.time())))
        await self._learn_slots()
        await self._become_ready()
        return True

    async def _close(self, redis: aioredis.Redis) -> None:
        if self.kv_events is not None:
            await self.kv_events.aclose()
        with contextlib.suppress(Exception):
            await self.registry.deregister(self.opts.worker_id)
            self.log.info("agent.deregistered")
        if self.process is not None:
            await self.process.stop()
            self.process.close()
        await self.http.aclose()
        await redis.aclose()

    def _on_signal(self, sig: signal.Signals) -> None:
        self.log.info("agent.signal", signal=sig.name)
        if self.stopping.is_set() and self.process is not None and self.process.running:
            # A second signal: stop waiting for the drain.
            self.process.signal_group(signal.SIGTERM)
        self.stopping.set()

    def _check_alive(self) -> None:
        if self.process is not None:
            self.process.check_alive()

    def _report_rejected(self, reason: str) -> None:
        hint = ("set FLEETGATE_REGISTRATION_SECRET for this agent to the same registration secret "
                "as the gateways")
        self.log.error("agent.rejected", reason=reason, hint=hint)
        print(f"the gateways ignore worker {self.opts.worker_id}'s record ({reason}): {hint}",
              file=sys.stderr, flush=True)

    # -- starting ---------------------------------------------------------------------

    async def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + self.opts.health_timeout_s
        last_beat = 0.0
        while time.monotonic() < deadline:
            if self.stopping.is_set():
                return False
            self._check_alive()
            if await self.probe.healthy_once():
                return True
            if time.monotonic() - last_beat >= self.opts.heartbeat_interval_s:
                last_beat = time.monotonic()
                await self._handle(await self.registration.beat(Load(ts=time.time())))
                await self.registration.check_rejected()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.25)
        url = self.opts.base_url + self.engine.health_path
        raise EngineDied(f"no healthy answer from {url} within {self.opts.health_timeout_s:.0f} s")

    def _start_speedometer(self) -> None:
        """The running measurement, seeded by the start-up figure; a declared --speed is the
        operator's word and stays as declared."""
        assert self.info is not None
        info = self.info
        self.speedometer = Speedometer(info.speed, info.speed_source, pinned=info.speed_source == "declared")
        self._logged_speed = (self.speedometer.speed, self.speedometer.source)

    def _with_speed(self, load: Load) -> Load:
        """`load` with the speed measured so far, after taking the scrape's work counters."""
        meter = self.speedometer
        if meter is None:
            return load
        if self.probe.work is not None:
            meter.observe(self.probe.work, time.monotonic())
        speed, source = meter.speed, meter.source
        logged, logged_source = self._logged_speed
        if source != logged_source or abs(speed - logged) > SPEED_LOG_STEP * logged:
            self.log.info("agent.speed_changed", speed=speed, source=source, was=logged, was_source=logged_source)
            self._logged_speed = (speed, source)
        return msgspec.structs.replace(load, speed=speed, speed_source=source)

    async def _check_runtime_lora(self) -> None:
        """An engine attached from outside may have been started without its runtime adapter
        API (vLLM without VLLM_ALLOW_RUNTIME_LORA_UPDATING): ask it, so that no gateway tries."""
        assert self.info is not None
        enabled = await self.engine.runtime_lora_enabled(self.http, self.opts.base_url)
        if not enabled:
            self.log.info("agent.runtime_lora_off", reason="the engine has no runtime adapter API")
            self.info = msgspec.structs.replace(self.info, runtime_lora=False)

    def _with_slots(self, load: Load) -> Load:
        """`load` with the engine's LoRA slots: its own report (vLLM's max_lora), else what it
        was started with; an engine whose adapters are all loaded at start has one for each."""
        assert self.info is not None
        info = self.info
        slots = load.lora_slots or info.max_loras or (0 if info.runtime_lora else len(info.adapters))
        return load if slots == load.lora_slots else msgspec.structs.replace(load, lora_slots=slots)

    async def _learn_slots(self) -> None:
        """Keep the registered slot count (WorkerInfo.max_loras: 0 for an engine attached
        without flags) in step with what the engine reports; every gateway reads it."""
        assert self.info is not None
        slots = self.load.lora_slots
        if not slots or slots == self.info.max_loras:
            return
        self.log.info("agent.lora_slots", slots=slots, was=self.info.max_loras)
        self.info = msgspec.structs.replace(self.info, max_loras=slots)
        if self.state != "starting":
            with contextlib.suppress(Exception):
                # On the record as it stands: a gateway may have changed its adapters since.
                view = await self.registry.read(self.opts.worker_id)
                base = view.info if view is not None else self.info
                await self.registry.update_info(msgspec.structs.replace(base, max_loras=slots))

    async def _become_ready(self) -> None:
        assert self.info is not None
        if await self.registration.was_removed():
            raise RemovedByOperator
        await self.registration.check_rejected()
        self.state = "ready"
        self.registration.watch_rejections_for(REJECTION_WATCH_S)
        await self._register_quietly("ready")
        self.log.info("agent.ready", url=self.info.url, model=self.info.model,
                      adapters=list(self.info.adapters), max_model_len=self.info.max_model_len,
                      kv_tokens=self.info.kv_tokens, speed=self.info.speed, speed_source=self.info.speed_source)

    # -- registry -----------------------------------------------------------------

    async def _register_quietly(self, state: WorkerState) -> None:
        assert self.info is not None
        await self.registration.register_quietly(self.info, state, self.load)

    async def _handle(self, reply: HeartbeatReply | None) -> None:
        """Act on a heartbeat's answer: the record's part (workers/registration.py), then
        stop when an operator asked for it."""
        assert self.info is not None
        await self.registration.handle(reply, self.info, self.state, self.load)
        if reply == "stop" and not self.stopping.is_set():
            self.log.info("agent.stop_requested", reason="an operator drained this worker with stop=true")
            self.stopping.set()

    # -- running --------------------------------------------------------------------

    async def _heartbeat_until_stopped(self) -> None:
        while not self.stopping.is_set():
            await self._tick()
            failures = self.probe.failures
            if not self.opts.managed and failures >= self.opts.max_missed_scrapes and (
                self.probe.failing_for_s >= self.opts.max_missed_scrapes * self.opts.heartbeat_interval_s
            ):
                raise EngineDied(f"{self.opts.base_url} failed {failures} probes in a row")
            # While probes fail, probe again sooner: a hung engine leaves routing within seconds.
            wait = self.opts.heartbeat_interval_s / (4 if failures else 1)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), wait)

    async def _tick(self) -> None:
        self._check_alive()
        load = await self.probe.scrape()
        self._check_alive()
        if load is not None:
            self.load = self._with_slots(self._with_speed(load))
            await self._learn_slots()
        unhealthy = self.probe.unhealthy
        # Not while probes fail: a hung engine would hold the heartbeat for the read's timeout
        # on top of the probe's, past the record's TTL (the worker would vanish, not turn unhealthy).
        if (self.state == "ready" and not self.probe.failures
                and time.monotonic() - self._discovered_at >= self.opts.rediscover_s):
            await self._rediscover()
        # Kept on the load, so that registering again (a lost record) says it too.
        self.load = msgspec.structs.replace(self.load, unhealthy=unhealthy)
        changed = bool(unhealthy) != self._published_unhealthy
        reply = await self.registration.beat(self.load, announce=changed)
        if reply is not None:
            self._published_unhealthy = bool(unhealthy)
        await self._handle(reply)
        await self.registration.check_rejected()

    async def _rediscover(self) -> None:
        """Adapters can be loaded and unloaded at runtime (by a gateway, or by hand): keep the
        registry's list in step with what the engine really serves."""
        assert self.info is not None
        self._discovered_at = time.monotonic()
        fresh = await self.probe.discover(self.info, self.opts.spec.served_name,
                                          timeout_s=max(self.opts.probe_timeout_s, 2.0))
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


def run_agent(options: AgentOptions, engine: Engine) -> int:
    return asyncio.run(Agent(options, engine).run())


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `python -m workers`")
