"""Holding an adapter request in the gateway while its engine's LoRA slots are busy with others.

The rule is the slot gate's (gateway/routing/lora_gate.py, over gateway/accounts/lora_state.py's
`slot_view`); the wait is the admission queue's hold (gateway/admission.py `hold`), one line
per (worker, adapter): a completion anywhere wakes each line's first request to check again,
and free slots go to the adapters held longest (the gate's rule). A request waits at most
`lora_slot_wait_max_s` from its arrival in all, then goes to its engine anyway (counted: a
never-freed slot, say one held by another client, cannot hold it for ever). Each hold is
counted by adapter and reason (fleetgate_adapter_slot_holds_total), each that ran out too
(fleetgate_adapter_slot_hold_timeouts_total), and the request's route says so
(`adapter-warm+slot-held` in the decision log and x-fleetgate-route).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from gateway.accounts.admission import Admission
from gateway.routing import Choice
from gateway.routing.lora_gate import Gate
from gateway.routing.table import Slot

if TYPE_CHECKING:
    from gateway.request.attempts import Attempt

log = structlog.get_logger("gateway.lora_hold")


class SlotHeld(Exception):
    """The chosen worker's LoRA slots are busy with other adapters: wait here (`hold_for_slot`)."""

    def __init__(self, slot: Slot, why: Gate) -> None:
        self.slot = slot
        self.why = why


def slot_gate(attempt: Attempt, slot: Slot) -> Gate | None:
    """Why the attempt's adapter request waits before going to `slot` (None: it goes): only
    while its slot wait has time left (`lora_slot_wait_max_s` from its arrival; 0: never)."""
    settings = attempt.dispatch.settings
    if settings.lora_slot_wait_max_s <= 0 or time.monotonic() - attempt.arrived >= settings.lora_slot_wait_max_s:
        return None
    return attempt.dispatch.placer.state.gate(slot, attempt.facts.model, attempt.arrived, settings.lora_slot_turn_s)


def steer(attempt: Attempt, choice: Choice) -> Choice:
    """Where an adapter request goes when the gate would hold it at the policy's choice: the
    worker its hold got a slot on, else where this gateway holds requests for the adapter (it
    joins their line rather than take a second engine's slot); else the choice."""
    state, model = attempt.dispatch.placer.state, attempt.facts.model
    target = attempt.slot_for or state.held_on(model)
    if not target or target == choice.slot.id:
        return choice
    routes = attempt.dispatch.watcher.snapshot.routes.by_model.get(model)
    slot = next((s for s in routes.routable if s.id == target), None) if routes is not None else None
    if slot is None or target in attempt.tried:
        return choice
    return Choice(slot, "adapter-held")


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


__all__ = ["SlotHeld", "hold_for_slot", "slot_gate", "steer"]
