"""Driving an `Attempt` until a worker answers: the queue, the holds and the one retry policy.

`run` re-places an evicted adapter, waits in the gateway's queue while every eligible worker
is full (gateway/accounts/admission.py), holds a request for KV room or a LoRA slot, and
retries a failure that reached no client byte on another worker.

The LoRA slot hold: the rule is the slot gate's (gateway/routing/lora_gate.py, over
gateway/accounts/lora_state.py's `slot_view`; `Attempt` asks it before it sends); the wait is
the admission queue's hold, one line per (worker, adapter): a completion anywhere wakes each
line's first request to check again, and free slots go to the adapters held longest (the
gate's rule). A request waits at most `lora_slot_wait_max_s` from its arrival in all, then goes
to its engine anyway (counted: a never-freed slot, say one held by another client, cannot hold
it for ever). Each hold is counted by adapter and reason (fleetgate_adapter_slot_holds_total),
each that ran out too (fleetgate_adapter_slot_hold_timeouts_total), and the request's route
says so (`adapter-warm+slot-held` in the decision log and x-fleetgate-route). `resume` starts a broken
stream's continuation on another worker under the same policy (`policy`): bounded in attempts
and in time, jittered exponential backoff, tenacity's, one log event per retry.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from fleetgate.schema import WorkerView
from gateway.accounts.admission import Admission
from gateway.engines.upstream import Response
from gateway.errors import ModelNotFound, NoWorkerAvailable, Overloaded, UpstreamError, detail
from gateway.observe.metrics import GatewayMetrics
from gateway.request.attempts import (
    DEFAULT_COMPLETION_TOKENS,
    Attempt,
    Held,
    Result,
    Retryable,
    Saturated,
    SlotHeld,
)
from gateway.routing import Choice
from gateway.routing.table import Slot
from gateway.settings import GatewaySettings

log = structlog.get_logger("gateway.attempts")


def policy(settings: GatewaySettings, attempts: int, before: Callable[[RetryCallState], None] | None = None) -> AsyncRetrying:
    """Tenacity's loop for `attempts` tries of a `Retryable` step, within `retry_max_s`."""
    return AsyncRetrying(
        stop=stop_after_attempt(attempts) | stop_after_delay(settings.retry_max_s),
        wait=wait_random_exponential(multiplier=settings.retry_backoff_s, max=1.0),
        retry=retry_if_exception_type(Retryable),
        reraise=True,
        before=before or (lambda _: None),
    )


async def run(attempt: Attempt, admission: Admission, metrics: GatewayMetrics) -> Result:
    """Attempt until a worker answers: re-place an evicted adapter once, queue while the
    fleet is full, retry a failure that reached no client byte."""
    placer, model = attempt.dispatch.placer, attempt.facts.model
    if attempt.facts.adapter and placer.known(model):
        await placer.ensure(model)
    while True:
        try:
            return await attempt.next()
        except ModelNotFound:
            if not (attempt.facts.adapter and placer.known(model)) or attempt.replaced:
                raise
            attempt.replaced = True  # evicted between its placement and now: place it again
            await placer.ensure(model)
        except Saturated:
            if attempt.falls_back:
                raise Overloaded(f"Every worker of `{model}` is full.", retry_after=1) from None
            await _wait_for_room(attempt, admission)
        except Held as held:
            await _hold(attempt, admission, held.slot)
        except SlotHeld as waits:  # its own name: compiled, `held` is typed by the clause above
            await hold_for_slot(attempt, admission, waits)
        except Retryable as first_failure:
            return await _retry(attempt, first_failure, metrics)


async def resume(attempt: Attempt, body: Callable[[WorkerView], bytes]) -> tuple[Choice, Response]:
    """Start the continuation of a broken stream on another worker, retried as a request is."""
    try:
        async for state in policy(attempt.dispatch.settings, attempt.dispatch.settings.retry_attempts):
            with state:
                choice, resp, _ = await attempt.next(body)
                if resp is None:  # not retried: only a `Retryable` is
                    raise UpstreamError("the engine refused the continuation")
                return choice, resp
    except Retryable:
        pass
    raise attempt.final_error() or NoWorkerAvailable("No other worker can continue this stream.")


async def _wait_for_room(attempt: Attempt, admission: Admission) -> None:
    """Hold a request while every eligible worker is full; bounded in count and time."""
    settings, priority = attempt.dispatch.settings, attempt.priority
    timeout = settings.queue_timeout_s if priority.queue_timeout_s is None else priority.queue_timeout_s
    if attempt.queue_deadline is None:
        attempt.queue_deadline = time.monotonic() + timeout
    facts = attempt.facts
    await admission.wait(facts.model, attempt.saturated, attempt.queue_deadline, retry_after=max(1.0, timeout / 2),
                         priority=priority.name, key=attempt.tenant,
                         tokens=facts.prompt_tokens + (facts.max_tokens or DEFAULT_COMPLETION_TOKENS))


async def _hold(attempt: Attempt, admission: Admission, slot: Slot) -> None:
    """Wait, at most `hold_max_s`, until `slot` has KV room for the request by the account
    (a completion there wakes it), rather than have its engine preempt to admit it."""
    attempt.held = True
    settings = attempt.dispatch.settings
    full_at, live, tokens = attempt.dispatch.full_at, attempt.dispatch.live, attempt.kv_tokens(slot)
    got = await admission.hold(slot.id, lambda: not full_at.holds(slot, live, tokens),
                               time.monotonic() + settings.hold_max_s)
    log.debug("gateway.hold", worker_id=slot.id, model=attempt.facts.model, room=got)


async def _retry(attempt: Attempt, failure: Retryable, metrics: GatewayMetrics) -> Result:
    settings = attempt.dispatch.settings
    if settings.retry_attempts <= 1:
        raise attempt.final_error() or failure.error
    try:
        async for state in policy(settings, settings.retry_attempts - 1, lambda _: _log_retry(attempt, metrics)):
            with state:
                return await attempt.next()
    except Retryable as last:
        raise attempt.final_error() or last.error from None
    raise failure.error  # pragma: no cover - tenacity either returns or raises


async def hold_for_slot(attempt: Attempt, admission: Admission, held: SlotHeld) -> None:
    """Wait until the gate lets the request go to `held.slot`'s worker (by its freshest record),
    or its slot wait runs out; then the request is placed again."""
    dispatch, model, arrived = attempt.dispatch, attempt.facts.model, attempt.arrived
    state, worker_id = dispatch.placer.state, held.slot.id
    until = arrived + dispatch.settings.lora_slot_wait_max_s
    turn_s = dispatch.settings.lora_slot_turn_s

    def room() -> bool:
        routes = dispatch.watcher.snapshot.routes.by_model.get(model)
        slot = next((s for s in routes.slots if s.id == worker_id), None) if routes is not None else None
        return slot is None or state.gate(slot, model, arrived, turn_s) is None

    state.hold(worker_id, model, arrived, held.why)
    started = time.monotonic()
    got = False
    try:
        got = await admission.hold(f"lora\0{worker_id}\0{model}", room, until)
    finally:
        state.unhold(worker_id, model, arrived, timed_out=not got and time.monotonic() >= until)
    attempt.slot_held = "slot-held" if got else "slot-timeout"
    if got:
        attempt.slot_for = worker_id
    log.debug("gateway.adapter_slot_held", worker=worker_id, adapter=model, why=held.why, got=got,
              ms=round((time.monotonic() - started) * 1000, 1))


def _log_retry(attempt: Attempt, metrics: GatewayMetrics) -> None:
    metrics.retry(attempt.facts.model)
    why = detail(attempt.last_error) if attempt.last_error else ""
    attempt.trace.retry(attempt.count + 1, why)
    log.info("gateway.retry", model=attempt.facts.model, attempt=attempt.count + 1, error=why)
