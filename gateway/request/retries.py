"""The waits an attempt makes in the gateway, and the one retry policy.

`Attempt.run` (gateway/request/attempts.py) drives a request's attempts and calls down to these:
`wait_for_room` waits in the gateway's queue while every eligible worker is full
(gateway/accounts/admission.py), `hold_for_room` holds a request for its worker's KV room,
`hold_for_slot` for a LoRA slot, and `retry` tries a step again on the one policy. None of them
knows the attempt: each takes what it waits on.

The LoRA slot hold: the rule is the slot gate's (gateway/routing/lora_gate.py, over
gateway/accounts/lora_state.py's `slot_view`; `Attempt` asks it before it sends); the wait is
the admission queue's hold, one line per (worker, adapter): a completion anywhere wakes each
line's first request to check again, and free slots go to the adapters held longest (the
gate's rule). A request waits at most `lora_slot_wait_max_s` from its arrival in all, then goes
to its engine anyway (counted: a never-freed slot, say one held by another client, cannot hold
it for ever). Each hold is counted by adapter and reason (fleetgate_adapter_slot_holds_total),
each that ran out too (fleetgate_adapter_slot_hold_timeouts_total), and the request's route
says so (`adapter-warm+slot-held` in the decision log and x-fleetgate-route). A failure that
reached no client byte, and a broken stream's continuation, are tried again under the same
policy (`policy`): bounded in attempts and in time, jittered exponential backoff, tenacity's,
one log event per retry.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from gateway.accounts.admission import Admission
from gateway.accounts.lora_state import LoraState
from gateway.accounts.priorities import Priority
from gateway.fleet import FleetWatcher
from gateway.routing import FullAt, Live, RequestFacts
from gateway.routing.lora_gate import Gate
from gateway.routing.table import Slot
from gateway.settings import GatewaySettings

log = structlog.get_logger("gateway.attempts")

T = TypeVar("T")
# What a request without max_tokens is expected to generate, for the KV account.
DEFAULT_COMPLETION_TOKENS = 256


def _nothing(_: RetryCallState) -> None:
    return None


def policy(settings: GatewaySettings, attempts: int, on: type[BaseException],
           before: Callable[[RetryCallState], None] | None = None) -> AsyncRetrying:
    """Tenacity's loop for `attempts` tries of a step that raises `on` to be tried again,
    within `retry_max_s`."""
    return AsyncRetrying(
        stop=stop_after_attempt(attempts) | stop_after_delay(settings.retry_max_s),
        wait=wait_random_exponential(multiplier=settings.retry_backoff_s, max=1.0),
        retry=retry_if_exception_type(on),
        reraise=True,
        before=before or _nothing,
    )


async def retry(step: Callable[[], Awaitable[T]], settings: GatewaySettings, attempts: int, on: type[BaseException],
                before: Callable[[RetryCallState], None] | None = None) -> T:
    """`step()`'s result, tried at most `attempts` times on the policy; its last `on` is raised."""
    async for state in policy(settings, attempts, on, before):
        with state:
            return await step()
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


async def wait_for_room(admission: Admission, facts: RequestFacts, priority: Priority, tenant: str,
                        saturated: Callable[[], str | None], deadline: float | None,
                        settings: GatewaySettings) -> float:
    """Hold a request while every eligible worker is full (`saturated()` says by which limit);
    bounded in count and time. Returns the queue's deadline, set on the first wait."""
    timeout = settings.queue_timeout_s if priority.queue_timeout_s is None else priority.queue_timeout_s
    if deadline is None:
        deadline = time.monotonic() + timeout
    await admission.wait(facts.model, saturated, deadline, retry_after=max(1.0, timeout / 2),
                         priority=priority.name, key=tenant,
                         tokens=facts.prompt_tokens + (facts.max_tokens or DEFAULT_COMPLETION_TOKENS))
    return deadline


async def hold_for_room(admission: Admission, slot: Slot, tokens: int, full_at: FullAt, live: Live,
                        settings: GatewaySettings, model: str) -> None:
    """Wait, at most `hold_max_s`, until `slot` has KV room for a request of `tokens` by the
    account (a completion there wakes it), rather than have its engine preempt to admit it."""
    got = await admission.hold(slot.id, lambda: not full_at.holds(slot, live, tokens),
                               time.monotonic() + settings.hold_max_s)
    log.debug("gateway.hold", worker_id=slot.id, model=model, room=got)


async def hold_for_slot(admission: Admission, watcher: FleetWatcher, state: LoraState, settings: GatewaySettings,
                        model: str, arrived: float, worker_id: str, why: Gate) -> bool:
    """Wait until the gate lets a request for the adapter `model`, arrived at `arrived`, go to
    `worker_id` (by its freshest record), or its slot wait runs out. Whether the gate let it."""
    until = arrived + settings.lora_slot_wait_max_s
    turn_s = settings.lora_slot_turn_s

    def room() -> bool:
        routes = watcher.snapshot.routes.by_model.get(model)
        slot = next((s for s in routes.slots if s.id == worker_id), None) if routes is not None else None
        return slot is None or state.gate(slot, model, arrived, turn_s) is None

    state.hold(worker_id, model, arrived, why)
    started = time.monotonic()
    got = False
    try:
        got = await admission.hold(f"lora\0{worker_id}\0{model}", room, until)
    finally:
        state.unhold(worker_id, model, arrived, timed_out=not got and time.monotonic() >= until)
    log.debug("gateway.adapter_slot_held", worker=worker_id, adapter=model, why=why, got=got,
              ms=round((time.monotonic() - started) * 1000, 1))
    return got
