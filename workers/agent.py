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
import socket
import sys
import time

import httpx
import msgspec
import structlog

from fleetgate.background import Outage
from fleetgate.registry import (
    HeartbeatReply,
    LoadNotStored,
    Registry,
    connect,
)
from fleetgate.schema import Load, WorkerInfo, WorkerState
from workers.engine_process import EngineDied, EngineProcess
from workers.engines import Engine
from workers.engines.base import pooling
from workers.kv_agent import AgentKvEvents
from workers.options import AgentOptions
from workers.probes import EngineProbe
from workers.speed import card_speed, known_profile
from workers.speedometer import Speedometer
from workers.tokenizer import tokenizer_path
from workers.warmup import StartFailed, log_tail, probe_speed, retrying, warm_up

log = structlog.get_logger("workers.agent")


class RemovedByOperator(Exception):
    pass


class Rejected(Exception):
    """The gateways ignore this worker's record; the message says why (registry.unsigned)."""


# Rejections are looked for while starting and this long after turning ready (registering
# clears the key; a gateway writes it again within ~2 s). Only then: a gateway that turns up
# later with the wrong secret must not take down workers that the others route to.
REJECTION_WATCH_S = 5.0
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
        # What the registry last told this agent an operator wants: re-asserted if Redis
        # loses the record.
        self.admin_drain = False
        self._published_unhealthy = False
        self._discovered_at = time.monotonic()
        self._watch_rejection_until = float("inf")
        self.log = log.bind(worker=options.worker_id, engine=options.engine)
        # Redis away, or full: said once when it starts and once when it ends, not every beat.
        self._unreachable = Outage(self.log, "agent.registry_unreachable", "agent.registry_reachable")
        self._full = Outage(self.log, "agent.registry_full", "agent.registry_writable")

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
        self.probe = EngineProbe(self.http, self.opts.base_url, self.engine, self.log,
                                 self.opts.probe_timeout_s, self.opts.unhealthy_after)
        code = 0
        try:
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
            self.info = self._initial_info()
            await self._register_quietly("starting")
            if not await self._wait_healthy():
                return 0 if self.stopping.is_set() else 1
            self.info = await self.probe.discover(self.info, self.opts.spec.served_name)
            if not self.opts.managed and self.info.runtime_lora:
                await self._check_runtime_lora()
            await self._warm_up()
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
            await self._heartbeat_until_stopped()
            await self._drain()
        except EngineDied as exc:
            self.log.error("agent.engine_died", reason=str(exc))
            code = 1
        except StartFailed as exc:
            self._report_failed_start(exc)
            code = 1
        except RemovedByOperator:
            self.log.info("agent.removed", reason="an operator removed this worker; stopping")
        except Rejected as exc:
            self._report_rejected(str(exc))
            code = 1
        finally:
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
        return code

    def _on_signal(self, sig: signal.Signals) -> None:
        self.log.info("agent.signal", signal=sig.name)
        if self.stopping.is_set() and self.process is not None and self.process.running:
            # A second signal: stop waiting for the drain.
            self.process.signal_group(signal.SIGTERM)
        self.stopping.set()

    def _check_alive(self) -> None:
        if self.process is not None:
            self.process.check_alive()

    def _report_failed_start(self, exc: StartFailed) -> None:
        tail = log_tail(self.opts.engine_log)
        self.log.error("agent.start_failed", reason=str(exc), engine_log=self.opts.engine_log,
                       engine_log_tail=tail)
        if tail:
            print(f"--- the last {len(tail)} lines of {self.opts.engine_log} ---", *tail,
                  "--- end of the engine's log ---", sep="\n", file=sys.stderr, flush=True)

    def _report_rejected(self, reason: str) -> None:
        hint = ("set FLEETGATE_REGISTRATION_SECRET for this agent to the same registration secret "
                "as the gateways")
        self.log.error("agent.rejected", reason=reason, hint=hint)
        print(f"the gateways ignore worker {self.opts.worker_id}'s record ({reason}): {hint}",
              file=sys.stderr, flush=True)

    # -- starting ---------------------------------------------------------------------

    def _initial_info(self) -> WorkerInfo:
        spec = self.opts.spec
        speed, source = 1.0, ""  # "": to be measured once the engine answers
        if self.opts.speed > 0:
            speed, source = self.opts.speed, "declared"
        elif self.opts.managed and known_profile(spec):
            speed, source = card_speed(spec), "profile"
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
            speed=speed,
            speed_source=source,
            runtime_lora=self.engine.runtime_lora,
            max_loras=self.engine.max_loras(spec),
            reports_load=self.engine.reports_load,
            continues_trailing_assistant=self.engine.continues_trailing_assistant(spec),
            pooling=pooling(spec),
            tokenizer=tokenizer_path(spec),
            heartbeat_s=self.opts.heartbeat_interval_s,
            agent_pid=os.getpid(),
            started_at=time.time(),
        )

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
                await self._handle(await self._beat(Load(ts=time.time())))
                await self._check_rejected()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.25)
        url = self.opts.base_url + self.engine.health_path
        raise EngineDied(f"no healthy answer from {url} within {self.opts.health_timeout_s:.0f} s")

    async def _warm_up(self) -> None:
        """The warm-up request, then the speed probe when nothing else gives the speed."""
        assert self.info is not None
        info, base = self.info, self.opts.base_url
        attempts = self.opts.warmup_attempts
        if self.opts.warmup:
            ms = await retrying("warm-up", lambda: warm_up(self.http, base, info), self.log, attempts)
            # warm_up raises unless the engine answered 200 on that route.
            route = "/v1/embeddings" if info.pooling else "/v1/completions"
            self.log.info("agent.warmup", ms=ms, route=route, status=200)
        if info.speed_source:
            self.log.info("agent.speed", speed=info.speed, source=info.speed_source)
            return
        if not self.opts.warmup or info.pooling:
            why = "--no-warmup" if not self.opts.warmup else "an embedding model generates nothing to time"
            self.info = msgspec.structs.replace(info, speed=1.0, speed_source="assumed")
            self.log.warning("agent.speed_assumed", speed=1.0, reason=f"not measured: {why}",
                             hint="declare the card's speed with --speed X (an H100 with a 7B model is 1.0)")
            return
        speed, figures = await retrying("speed probe", lambda: probe_speed(self.http, base, info), self.log, attempts)
        self.info = msgspec.structs.replace(info, speed=speed, speed_source="measured")
        self.log.info("agent.speed", speed=speed, source="measured", **figures)

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
        if await self._was_removed():
            raise RemovedByOperator
        await self._check_rejected()
        self.state = "ready"
        self._watch_rejection_until = time.monotonic() + REJECTION_WATCH_S
        await self._register_quietly("ready")
        self.log.info("agent.ready", url=self.info.url, model=self.info.model,
                      adapters=list(self.info.adapters), max_model_len=self.info.max_model_len,
                      kv_tokens=self.info.kv_tokens, speed=self.info.speed, speed_source=self.info.speed_source)

    # -- registry -----------------------------------------------------------------

    async def _register_quietly(self, state: WorkerState) -> None:
        assert self.info is not None
        try:
            await self.registry.register(self.info, state, self.load, admin_drain=self.admin_drain)
        except Exception as exc:  # Redis down: keep the engine, retry on the next beat
            self._unreachable.failed(exc)

    async def _was_removed(self) -> bool:
        """Whether an operator removed this worker since it started (False while Redis is away:
        the next heartbeat asks again)."""
        try:
            return await self.registry.was_removed(self.opts.worker_id)
        except Exception as exc:
            self._unreachable.failed(exc)
            return False

    async def _check_rejected(self) -> None:
        """Raise Rejected if a gateway said it ignores this record (while still watching)."""
        if time.monotonic() > self._watch_rejection_until:
            return
        try:
            reason = await self.registry.rejection(self.opts.worker_id)
        except Exception as exc:  # Redis away: the next beat asks again
            self._unreachable.failed(exc)
            return
        if reason:
            raise Rejected(reason)

    async def _beat(self, load: Load, announce: bool = False) -> HeartbeatReply | None:
        """The registry's answer to a heartbeat; None when Redis is unreachable."""
        try:
            if moved := await self.registry.follow_master():
                self.log.warning("agent.registry_master_moved", master=moved)
            reply = await self.registry.heartbeat(self.opts.worker_id, load, announce=announce)
        except LoadNotStored as exc:  # the record lives on, with the load last stored
            self._unreachable.ok()
            self._full.failed(exc.__cause__ or exc, reason=str(exc))
            return exc.reply
        except Exception as exc:
            self._unreachable.failed(exc)
            return None
        self._unreachable.ok()
        self._full.ok()
        return reply

    async def _handle(self, reply: HeartbeatReply | None) -> None:
        """Act on a heartbeat's answer: remember the operator's drain, stop when asked,
        register again when the record is gone (unless an operator removed it)."""
        if reply is None:  # nothing learnt while Redis is away
            return
        if reply == "missing":
            if await self._was_removed():
                raise RemovedByOperator
            self.log.warning("agent.reregister", reason="record missing in Redis", state=self.state,
                             admin_drain=self.admin_drain)
            await self._register_quietly(self.state)
            return
        drained = reply in ("drained", "stop")
        if drained != self.admin_drain:
            self.log.info("agent.admin_drain", drained=drained)
        self.admin_drain = drained
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
        reply = await self._beat(self.load, announce=changed)
        if reply is not None:
            self._published_unhealthy = bool(unhealthy)
        await self._handle(reply)
        await self._check_rejected()

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
