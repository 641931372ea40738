"""The adapter slot gate: whether a LoRA request may go to its engine now, or waits in the gateway.

vLLM runs at most `max_loras` distinct adapters in a batch; a waiting request whose adapter
finds every slot busy with others is skipped, with no fairness, so on an engine with more
adapters in demand than slots the rare ones wait until the load stops (issue 36: p99 37 s at
2 engines x 4 slots). The gateway holds such a request itself instead, where it can be fair:

- **slot**: its adapter is not live on the engine and every slot there is (the engine's last
  report, corrected by what the gateways sent and finished since: gateway/accounts/lora_state.py), or
  the free ones are owed to adapters held longer (held requests go in arrival order);
- **turn**: its adapter is live there, every slot is busy, other adapters are held for one, and
  this adapter has had its slot for `turn_s` (its turn began when it came into use there): it
  stops taking new requests on that engine so that its slot frees once the requests in flight
  finish. The adapters with the most requests in flight there keep half the slots (a hot
  adapter's every request would wait a round of turns); of the others whose turns are up, those
  with the fewest requests in flight yield first (then those whose turns began first), one per
  adapter held.

Never held: where the engine's slots are unknown or hold all its adapters, and where a slot is
free that no adapter held before it is owed. The caller bounds the wait (then sends anyway).
Pure: a function over a frozen view, table-tested (tests/unit/test_lora_gate.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Gate = Literal["slot", "turn"]


@dataclass(frozen=True, slots=True)
class SlotView:
    """One engine's LoRA slots as the gate reads them."""

    # Its slots; 0: unknown, or every adapter it serves fits (no adapter ever waits there).
    limit: int
    # The adapters live there now (by the report corrected by the sends since).
    live: frozenset[str]
    # Live adapter -> when its current turn there began (monotonic s), for those this gateway
    # sent there; an adapter live only by the report (another client's) is not asked to yield.
    since: Mapping[str, float] = field(default_factory=dict)
    # Adapter -> when its oldest request held for a slot there arrived (monotonic s).
    held: Mapping[str, float] = field(default_factory=dict)
    # Live adapter -> its requests in flight there by the gateways' account.
    busy: Mapping[str, int] = field(default_factory=dict)


def gate(view: SlotView, adapter: str, arrived: float, now: float, turn_s: float) -> Gate | None:
    """Why a request for `adapter` that arrived at `arrived` waits for `view`'s engine; None: send."""
    limit = view.limit
    if limit <= 0:
        return None
    live = view.live
    free = limit - len(live)
    if adapter in live:
        return "turn" if free <= 0 and _yields(view, adapter, now, turn_s) else None
    if free <= 0:
        return "slot"
    # Free slots go to the adapters held longest first (by each one's oldest held request):
    # this one only if fewer are ahead of it.
    mine = min(arrived, view.held.get(adapter, arrived))
    ahead = sum(1 for a, at in view.held.items() if a != adapter and a not in live and at < mine)
    return "slot" if ahead >= free else None


def _yields(view: SlotView, adapter: str, now: float, turn_s: float) -> bool:
    """Whether `adapter`'s turn on a full engine is up: others wait for a slot, its turn has
    lasted `turn_s`, and it is among those (one per adapter waiting) with the fewest requests in
    flight there, then whose turns began first: the quickest slots to free, and a hot adapter,
    whose every request would wait a whole round of turns, keeps its slot while colder ones
    take turns on the rest."""
    waiting = sum(1 for a in view.held if a not in view.live)
    began = view.since.get(adapter)
    if not waiting or began is None or now - began < turn_s:
        return False
    busy = view.busy
    # The busiest half of the slots never rotate: their adapters' traffic would all wait.
    keep = {a for _, a in sorted((-busy.get(a, 0), a) for a in view.live)[:view.limit // 2]}
    if adapter in keep:
        return False
    done = sorted((busy.get(a, 0), at, a) for a, at in view.since.items()
                  if a in view.live and a not in keep and now - at >= turn_s)
    return any(a == adapter for _, _, a in done[:waiting])


__all__ = ["Gate", "SlotView", "gate"]
