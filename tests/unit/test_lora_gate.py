"""The adapter slot gate (gateway/routing/lora_gate.py): when an adapter request waits in the
gateway for a LoRA slot on its engine, and when it goes; and its view of an engine built from the
gateway's account and the engine's report (gateway/accounts/lora_state.py `slot_view`)."""

from __future__ import annotations

import time

import pytest

from fleetgate.hashing import stable_hash
from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.accounts.lora_state import LoraState
from gateway.routing.lora_gate import SlotView, gate
from gateway.routing.table import Slot

NOW = 1000.0  # monotonic seconds
TURN = 2.0


def view(limit: int, live: str = "", since: dict[str, float] | None = None,
         held: dict[str, float] | None = None, busy: dict[str, int] | None = None) -> SlotView:
    return SlotView(limit, frozenset(live.split()), since or {}, held or {}, busy or {})


def full(a: float | None, b: float | None, held: str = "c", busy_a: int = 0, busy_b: int = 0,
         limit: int = 4) -> SlotView:
    """Four slots live with two hot adapters (h1, h2: many requests in flight) and two colder
    ones (a, b, whose turns began at `a` and `b`; None: live only by the engine's report), and
    the adapters in `held` held for a slot."""
    since = {k: v for k, v in {"h1": NOW - 60.0, "h2": NOW - 60.0, "a": a, "b": b}.items() if v is not None}
    return view(limit, "h1 h2 a b", since, dict.fromkeys(held.split(), NOW - 0.5),
                {"h1": 20, "h2": 20, "a": busy_a, "b": busy_b})


CASES = [
    # (what it shows, engine, adapter, arrived, expected)
    ("slots unknown (or every adapter fits): never held", view(0, "a b c"), "d", NOW, None),
    ("a free slot and nobody held: it goes", view(2, "a"), "b", NOW, None),
    ("its adapter is live there with a free slot: it goes", view(2, "a"), "a", NOW, None),
    ("every slot live with other adapters: held for a slot", view(2, "a b"), "c", NOW, "slot"),
    ("its adapter live on a full engine, nobody held: it goes", view(2, "a b", {"a": NOW - 60}), "a", NOW, None),
    ("a free slot owed to an adapter held before it: held",
     view(2, "a", held={"x": NOW - 1}), "b", NOW, "slot"),
    ("... two free slots, one adapter held before it: it goes",
     view(3, "a", held={"x": NOW - 1}), "b", NOW, None),
    ("... the adapter held first takes the free slot",
     view(2, "a", held={"x": NOW - 1, "b": NOW - 2}), "b", NOW - 2, None),
    ("... and its later requests too (those held after it do not count)",
     view(2, "a", held={"x": NOW - 1, "b": NOW - 2}), "b", NOW, None),
    ("a free slot is never owed to an adapter already live there",
     view(2, "a", held={"a": NOW - 1}), "b", NOW, None),
    ("turn up: full, another adapter held, its turn began turn_s ago: it yields",
     full(a=NOW - 3, b=NOW - 1), "a", NOW, "turn"),
    ("... not before turn_s", full(a=NOW - 1.5, b=NOW - 1), "a", NOW, None),
    ("... one adapter yields per adapter held: the one whose turn began first",
     full(a=NOW - 9, b=NOW - 5), "b", NOW, None),
    ("... two held: two yield", full(a=NOW - 9, b=NOW - 5, held="c d"), "b", NOW, "turn"),
    ("... of those whose turns are up, the one with the fewest requests in flight yields",
     full(a=NOW - 5, b=NOW - 9, busy_a=1, busy_b=3), "a", NOW, "turn"),
    ("... and not the other", full(a=NOW - 5, b=NOW - 9, busy_a=1, busy_b=3), "b", NOW, None),
    ("... unless the colder one's turn is not up yet",
     full(a=NOW - 1, b=NOW - 9, busy_a=1, busy_b=3), "b", NOW, "turn"),
    ("the busiest adapters keep half the slots, however long their turns and however many wait",
     full(a=NOW - 9, b=NOW - 5, held="c d e f"), "h1", NOW, None),
    ("its own held requests are no reason to yield", full(a=NOW - 9, b=NOW - 5, held="a"), "a", NOW, None),
    ("an adapter live only by the engine's report (no turn known here) is not asked to yield",
     full(a=None, b=NOW - 1), "a", NOW, None),
    ("... and the adapter with a known turn is the one that yields", full(a=None, b=NOW - 5), "b", NOW, "turn"),
    ("never yields while a slot is free (the held one takes that)",
     full(a=NOW - 9, b=NOW - 5, limit=5), "a", NOW, None),
]


@pytest.mark.parametrize(("what", "engine", "adapter", "arrived", "expected"), CASES, ids=[c[0] for c in CASES])
def test_gate(what: str, engine: SlotView, adapter: str, arrived: float, expected: str | None) -> None:
    assert gate(engine, adapter, arrived, NOW, TURN) == expected, what


def slot(wid: str = "w", slots: int = 2, active: tuple[str, ...] = (), report_at: float | None = None,
         adapters: tuple[str, ...] = ("a", "b", "c", "d")) -> Slot:
    return Slot(WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="external:vllm", model="base", adapters=adapters,
                        runtime_lora=True, capacity=64),
        state="ready", load=Load(lora_slots=slots, lora_active=active,
                                 ts=time.time() - 1 if report_at is None else report_at),
        id_hash=stable_hash(wid),
    ))


def fresh_state() -> LoraState:
    return LoraState(None, "gw-test")  # type: ignore[arg-type]  # no Redis: only its local account is read


def test_never_held_where_the_engine_reports_a_free_slot_and_nothing_was_sent_since() -> None:
    state = fresh_state()
    assert state.gate(slot(active=("a",)), "c", time.monotonic(), TURN) is None


def test_held_where_the_report_and_the_sends_since_fill_every_slot() -> None:
    state = fresh_state()
    state.started("w", "b")
    assert state.slot_view(slot(active=("a",))).live == {"a", "b"}
    assert state.gate(slot(active=("a",)), "c", time.monotonic(), TURN) == "slot"


def test_an_adapter_finished_since_the_report_frees_its_slot() -> None:
    state = fresh_state()
    state.started("w", "b")
    state.finished("w", "b")
    engine = slot(active=("a", "b"), report_at=time.time() - 5)
    assert state.slot_view(engine).live == {"a"}
    assert state.gate(engine, "c", time.monotonic(), TURN) is None


def test_an_engine_whose_adapters_all_fit_is_never_gated() -> None:
    state = fresh_state()
    engine = slot(slots=2, active=("a", "b"), adapters=("a", "b"))
    assert state.gate(engine, "c", time.monotonic(), TURN) is None


def test_a_turn_begins_with_the_first_request_and_ends_with_the_last() -> None:
    state = fresh_state()
    state.started("w", "a")
    began = state.turns[("w", "a")]
    state.started("w", "a")
    state.finished("w", "a")
    assert state.turns[("w", "a")] == began  # one still in flight: the same turn
    state.finished("w", "a")
    assert ("w", "a") not in state.turns


def test_held_requests_are_counted_and_their_oldest_arrival_is_what_the_gate_reads() -> None:
    state = fresh_state()
    state.hold("w", "c", 5.0, "slot")
    state.hold("w", "c", 7.0, "slot")
    assert state.slot_view(slot(active=("a", "b"))).held == {"c": 5.0}
    state.unhold("w", "c", 5.0, timed_out=True)
    assert state.slot_view(slot(active=("a", "b"))).held == {"c": 7.0}
    state.unhold("w", "c", 7.0, timed_out=False)
    assert state.held == {}
    assert state.slot_holds == {("c", "slot"): 2} and state.slot_hold_timeouts == {"c": 1}
