"""What an attempt at a request needs, and what it says when it does not send.

`Dispatch` holds the few collaborators a send needs (never the whole proxy); `Saturated`,
`Held`, `SlotHeld` and `Retryable` are the reasons `Attempt.next` (gateway/request/attempts.py)
did not get an answer, each of which `Attempt.until_answered` answers in its own way.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.accounts.adapters import AdapterPlacer
from gateway.accounts.admission import Admission
from gateway.accounts.circuit import Breakers
from gateway.accounts.inflight import SharedInflight
from gateway.accounts.placement import Placement
from gateway.accounts.waiting import FirstByteWaits
from gateway.engines.upstream import Response, Upstream
from gateway.errors import GatewayError
from gateway.fleet import FleetWatcher
from gateway.observe.metrics import GatewayMetrics
from gateway.routing import Choice, FullAt, Live, Policy
from gateway.routing.lora_gate import Gate
from gateway.routing.table import Slot
from gateway.settings import GatewaySettings

FORWARD_HEADERS = {"content-type": "application/json"}


class Retryable(Exception):
    """An attempt failed before any byte reached the client: another worker may answer.
    `final`: what the client gets if the attempts end here (`Attempt.final_error`)."""

    def __init__(self, error: GatewayError, final: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error
        self.final = final


class Held(Exception):
    """The chosen worker's KV cache is full by the account for the request's `tokens`: wait
    there a moment (gateway/request/retries.py `wait_out`)."""

    def __init__(self, slot: Slot, tokens: int) -> None:
        self.slot = slot
        self.tokens = tokens


class Saturated(Exception):
    """Every eligible worker is full: the request waits in the gateway's queue."""


class SlotHeld(Exception):
    """The chosen worker's LoRA slots are busy with other adapters: the request waits in the
    gateway for one (gateway/request/retries.py `wait_out`)."""

    def __init__(self, slot: Slot, why: Gate) -> None:
        self.slot = slot
        self.why = why


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What an attempt needs: the fleet and the policy to choose, the engines' session to
    send, the accounts a send keeps (in flight, adapters in use, breakers, waits), the queue
    and holds it waits in, and the series its retries move."""

    settings: GatewaySettings
    watcher: FleetWatcher
    upstream: Upstream
    policy: Policy
    live: Live
    inflight: SharedInflight
    placer: AdapterPlacer
    placement: Placement
    breakers: Breakers
    waits: FirstByteWaits
    full_at: FullAt  # settings.full_at, built once (settings do not change while the gateway runs)
    admission: Admission
    metrics: GatewayMetrics


# (choice, open streaming response or None, (status, body) when not streaming)
Result = tuple[Choice, Response | None, tuple[int, bytes]]


__all__ = ["FORWARD_HEADERS", "Dispatch", "Held", "Result", "Retryable", "Saturated", "SlotHeld"]
