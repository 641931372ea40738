"""A worker's record in the registry, as its agent keeps it there.

What the record first says (`initial_info`), and the agent's conversation with the registry
through Redis's outages (`Registration`): registering, the heartbeat and what its answer
asks for (an operator's drain remembered and re-asserted, a stop, a lost record registered
again), an operator's removal, and a gateway's rejection of the record. Redis away, or
full, is said once when it starts and once when it ends, never raised: the agent keeps its
engine and the next beat tries again. What an answer asks of the engine itself (stop,
drain) is the agent's to do (workers/agent.py).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from fleetgate.background import Outage
from fleetgate.registry import HeartbeatReply, LoadNotStored, Registry
from fleetgate.schema import Load, WorkerInfo, WorkerState
from workers.engines import Engine
from workers.engines.base import pooling
from workers.options import AgentOptions
from workers.speed import card_speed, known_profile
from workers.tokenizer import tokenizer_path


class RemovedByOperator(Exception):
    pass


class Rejected(Exception):
    """The gateways ignore this worker's record; the message says why (registry.unsigned)."""


# Rejections are looked for while starting and this long after turning ready (registering
# clears the key; a gateway writes it again within ~2 s). Only then: a gateway that turns up
# later with the wrong secret must not take down workers that the others route to.
REJECTION_WATCH_S = 5.0


def initial_info(opts: AgentOptions, engine: Engine) -> WorkerInfo:
    """The record a worker registers with while its engine starts: the speed is declared,
    a known card's profile, or (source "") to be measured once the engine answers."""
    spec = opts.spec
    speed, source = 1.0, ""
    if opts.speed > 0:
        speed, source = opts.speed, "declared"
    elif opts.managed and known_profile(spec):
        speed, source = card_speed(spec), "profile"
    return WorkerInfo(
        id=opts.worker_id,
        url=opts.base_url,
        engine=opts.engine if opts.managed else f"external:{opts.engine}",
        model=spec.served_name,
        adapters=tuple(spec.adapters),
        max_model_len=spec.max_model_len,
        gpu=spec.gpu,
        host=socket.gethostname(),
        capacity=engine.capacity(spec),
        speed=speed,
        speed_source=source,
        runtime_lora=engine.runtime_lora,
        max_loras=engine.max_loras(spec),
        reports_load=engine.reports_load,
        continues_trailing_assistant=engine.continues_trailing_assistant(spec),
        pooling=pooling(spec),
        tokenizer=tokenizer_path(spec),
        heartbeat_s=opts.heartbeat_interval_s,
        agent_pid=os.getpid(),
        started_at=time.time(),
    )


class Registration:
    """One worker's side of the registry: its writes and what the registry tells it."""

    def __init__(self, registry: Registry, worker_id: str, log: Any) -> None:
        self.registry = registry
        self.worker_id = worker_id
        self.log = log
        # What the registry last said an operator wants: re-asserted if Redis loses the record.
        self.admin_drain = False
        self._watch_rejection_until = float("inf")
        # Redis away, or full: said once when it starts and once when it ends, not every beat.
        self._unreachable = Outage(log, "agent.registry_unreachable", "agent.registry_reachable")
        self._full = Outage(log, "agent.registry_full", "agent.registry_writable")

    def watch_rejections_for(self, seconds: float) -> None:
        """Look for rejections only this much longer (REJECTION_WATCH_S says why)."""
        self._watch_rejection_until = time.monotonic() + seconds

    async def register_quietly(self, info: WorkerInfo, state: WorkerState, load: Load) -> None:
        try:
            await self.registry.register(info, state, load, admin_drain=self.admin_drain)
        except Exception as exc:  # Redis down: keep the engine, retry on the next beat
            self._unreachable.failed(exc)

    async def was_removed(self) -> bool:
        """Whether an operator removed this worker since it started (False while Redis is away:
        the next heartbeat asks again)."""
        try:
            return await self.registry.was_removed(self.worker_id)
        except Exception as exc:
            self._unreachable.failed(exc)
            return False

    async def check_rejected(self) -> None:
        """Raise Rejected if a gateway said it ignores this record (while still watching)."""
        if time.monotonic() > self._watch_rejection_until:
            return
        try:
            reason = await self.registry.rejection(self.worker_id)
        except Exception as exc:  # Redis away: the next beat asks again
            self._unreachable.failed(exc)
            return
        if reason:
            raise Rejected(reason)

    async def beat(self, load: Load, announce: bool = False) -> HeartbeatReply | None:
        """The registry's answer to a heartbeat; None when Redis is unreachable."""
        try:
            if moved := await self.registry.follow_master():
                self.log.warning("agent.registry_master_moved", master=moved)
            reply = await self.registry.heartbeat(self.worker_id, load, announce=announce)
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

    async def handle(self, reply: HeartbeatReply | None, info: WorkerInfo, state: WorkerState, load: Load) -> None:
        """Act on a heartbeat's answer as far as the record goes: remember the operator's
        drain, register again when the record is gone (unless an operator removed it)."""
        if reply is None:  # nothing learnt while Redis is away
            return
        if reply == "missing":
            if await self.was_removed():
                raise RemovedByOperator
            self.log.warning("agent.reregister", reason="record missing in Redis", state=state,
                             admin_drain=self.admin_drain)
            await self.register_quietly(info, state, load)
            return
        drained = reply in ("drained", "stop")
        if drained != self.admin_drain:
            self.log.info("agent.admin_drain", drained=drained)
        self.admin_drain = drained
