"""The waits an attempt makes in the gateway, and the one retry policy.

`Attempt.until_answered` (gateway/request/attempts.py) drives a request's attempts and calls
down here: `wait_out` waits out why an attempt did not send (every eligible worker full: the
gateway's queue, gateway/accounts/admission.py; its worker's KV cache full: a hold for room;
its worker's LoRA slots busy: a hold for a slot), and `tries` tries a step on the one policy.
What a wait reads and writes of the attempt is `Waiting`; this module does not import it.

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
from typing import Protocol, TypeVar

import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from gateway.accounts.priorities import Priority
from gateway.errors import Overloaded
from gateway.request.dispatch import Dispatch, Held, Retryable, Saturated, SlotHeld
from gateway.routing import RequestFacts
from gateway.settings import GatewaySettings

log = structlog.get_logger("gateway.attempts")

T = TypeVar("T")
# What a request without max_tokens is expected to generate, for the KV account.
DEFAULT_COMPLETION_TOKENS = 256


class Waiting(Protocol):
    """What a wait reads of an attempt, and what it writes back (its queue deadline, that it
    held for KV room, how its LoRA slot hold went)."""

    dispatch: Dispatch
    facts: RequestFacts
    priority: Priority
    tenant: str
    arrived: float
    falls_back: bool
    queue_deadline: float | None
    held: bool
    slot_held: str
    slot_for: str

    def saturated(self) -> str | None: ...


def _nothing(_: RetryCallState) -> None:
    return None


def policy(settings: GatewaySettings, attempts: int, before: Callable[[RetryCallState], None] | None = None,
           ) -> AsyncRetrying:
    """Tenacity's loop for `attempts` tries of a step that raises `Retryable` to be tried
    again, within `retry_max_s`."""
    return AsyncRetrying(
        stop=stop_after_attempt(attempts) | stop_after_delay(settings.retry_max_s),
        wait=wait_random_exponential(multiplier=settings.retry_backoff_s, max=1.0),
        retry=retry_if_exception_type(Retryable),
        reraise=True,
        before=before or _nothing,
    )


async def tries(step: Callable[[], Awaitable[T]], settings: GatewaySettings, attempts: int,
                before: Callable[[RetryCallState], None] | None = None) -> T:
    """`step()`'s result, tried at most `attempts` times on the policy; when the tries run out,
    what the client gets (the last `Retryable`'s `final`)."""
    try:
        async for state in policy(settings, attempts, before):
            with state:
                return await step()
    except Retryable as last:
        raise last.final from None
    raise AssertionError("unreachable: tenacity either returns or raises")  # pragma: no cover


async def wait_out(why: Saturated | Held | SlotHeld, attempt: Waiting) -> None:
    """Wait out why `attempt` did not send; then it is placed again."""
    dispatch, facts = attempt.dispatch, attempt.facts
    settings, admission = dispatch.settings, dispatch.admission
    if isinstance(why, SlotHeld):  # its worker's LoRA slots are busy with other adapters
        await _hold_for_slot(why, attempt, dispatch, settings)
    elif isinstance(why, Saturated):  # every eligible worker is full: the queue, bounded in count and time
        if attempt.falls_back:
            raise Overloaded(f"Every worker of `{facts.model}` is full.", retry_after=1)
        priority = attempt.priority
        timeout = settings.queue_timeout_s if priority.queue_timeout_s is None else priority.queue_timeout_s
        if attempt.queue_deadline is None:
            attempt.queue_deadline = time.monotonic() + timeout
        await admission.wait(facts.model, attempt.saturated, attempt.queue_deadline,
                             retry_after=max(1.0, timeout / 2), priority=priority.name, key=attempt.tenant,
                             tokens=facts.prompt_tokens + (facts.max_tokens or DEFAULT_COMPLETION_TOKENS))
    else:  # its worker's KV cache is full by the account
        # At most `hold_max_s`, until the worker has KV room for the request by the account (a
        # completion there wakes it), rather than have its engine preempt to admit it; once.
        attempt.held = True
        slot, tokens, full_at, live = why.slot, why.tokens, dispatch.full_at, dispatch.live
        got = await admission.hold(slot.id, lambda: not full_at.holds(slot, live, tokens),
                                   time.monotonic() + settings.hold_max_s)
        log.debug("gateway.hold", worker_id=slot.id, model=facts.model, room=got)


async def _hold_for_slot(why: SlotHeld, attempt: Waiting, dispatch: Dispatch, settings: GatewaySettings) -> None:
    """Until the gate lets the adapter request go to `why.slot`'s worker (by its freshest
    record), or its slot wait runs out."""
    model, arrived, worker_id = attempt.facts.model, attempt.arrived, why.slot.id
    state, watcher, turn_s = dispatch.placer.state, dispatch.watcher, settings.lora_slot_turn_s
    until = arrived + settings.lora_slot_wait_max_s

    def room() -> bool:
        routes = watcher.snapshot.routes.by_model.get(model)
        slot = next((s for s in routes.slots if s.id == worker_id), None) if routes is not None else None
        return slot is None or state.gate(slot, model, arrived, turn_s) is None

    state.hold(worker_id, model, arrived, why.why)
    started = time.monotonic()
    got = False
    try:
        got = await dispatch.admission.hold(f"lora\0{worker_id}\0{model}", room, until)
    finally:
        state.unhold(worker_id, model, arrived, timed_out=not got and time.monotonic() >= until)
    attempt.slot_held = "slot-held" if got else "slot-timeout"
    if got:
        attempt.slot_for = worker_id
    log.debug("gateway.adapter_slot_held", worker=worker_id, adapter=model, why=why.why, got=got,
              ms=round((time.monotonic() - started) * 1000, 1))
