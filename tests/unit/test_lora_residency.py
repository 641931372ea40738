"""Where an adapter is live and where every LoRA slot is taken (gateway/accounts/lora_state.py): the
facts the fleet policy places adapter requests by, from the gateways' requests in flight, the
engines' own reports and when each adapter was last sent where."""

from __future__ import annotations

import math
import time

import pytest

from fleetgate.hashing import stable_hash
from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.accounts.lora_state import (
    LoraState,
    fleet_spare,
    live_adapters,
    residency,
    slot_wait,
    still_reported,
)
from gateway.routing.table import Slot

NOW = time.time()
ADAPTERS = ("fin", "law", "med", "tax")


def slot(wid: str, slots: int = 2, active: tuple[str, ...] = (), report_at: float = NOW - 1.0,
         registered: int = 0, adapters: tuple[str, ...] = ADAPTERS, running: int = 0, kv: float = 0.0) -> Slot:
    return Slot(WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="external:vllm", model="base", adapters=adapters,
                        runtime_lora=True, max_loras=registered, capacity=64),
        state="ready", load=Load(lora_slots=slots, lora_active=active, ts=report_at, running=running,
                                 kv_cache_usage=kv), id_hash=stable_hash(wid),
    ))


def state(inflight: dict[tuple[str, str], int] | None = None, remote: dict[tuple[str, str], int] | None = None,
          used: dict[tuple[str, str], float] | None = None, watching_s: float = 60.0) -> LoraState:
    s = LoraState(None, "gw-test")  # type: ignore[arg-type]  # no Redis: only its local account is read
    s.watching_since = NOW - watching_s  # past its warm-up (30 s) by default
    s.local.update(inflight or {})
    s.remote.update(remote or {})
    s.used.update(used or {})
    return s


CASES = [
    # (what it shows, workers, state, expected warm, expected full)
    ("live where this gateway has its requests in flight",
     [slot("a"), slot("b")], state({("a", "fin"): 1}), {"a"}, set()),
    ("live where another replica has them (shared through Redis)",
     [slot("a"), slot("b")], state(remote={("b", "fin"): 2}), {"b"}, set()),
    ("live where the engine's report names it and no gateway sent or finished it since (another client)",
     [slot("a", active=("fin",)), slot("b")], state(), {"a"}, set()),
    ("full where every slot is live with other adapters, by requests and by report alike",
     [slot("a", active=("law",)), slot("b")], state({("a", "med"): 1}), set(), {"a"}),
    ("live on an engine with more adapters than slots: warm and full (it may be among the waiting)",
     [slot("a"), slot("b")], state({("a", "fin"): 1, ("a", "law"): 1, ("a", "med"): 1}), {"a"}, {"a"}),
    ("live nowhere: back where it was last sent, while a slot is free there",
     [slot("a"), slot("b")], state(used={("a", "fin"): NOW - 20, ("b", "fin"): NOW - 5}), {"b"}, set()),
    ("... not where every slot has been taken by others since",
     [slot("a"), slot("b")],
     state({("b", "law"): 1, ("b", "med"): 1}, used={("a", "fin"): NOW - 20, ("b", "fin"): NOW - 5}),
     {"a"}, {"b"}),
    ("... and not after recent_s (30 s)",
     [slot("a"), slot("b")], state(used={("b", "fin"): NOW - 31}), set(), set()),
    ("a new adapter spreads: only the engines with the most free slots are open to it",
     [slot("a", slots=3), slot("b", slots=3), slot("c", slots=3)],
     state({("a", "law"): 1, ("b", "law"): 1, ("b", "med"): 1}), set(), {"a", "b"}),
    ("... but it goes back where it last ran while a slot is free there",
     [slot("a", slots=3), slot("b", slots=3)],
     state({("b", "law"): 1, ("b", "med"): 1}, used={("b", "fin"): NOW - 20}), {"b"}, set()),
    ("slots unknown (an engine that reports none, registered 0): never full",
     [slot("a", slots=0)], state({("a", "law"): 1, ("a", "med"): 1, ("a", "tax"): 1}), set(), set()),
    ("the registered figure stands in where the engine reports none",
     [slot("a", slots=0, registered=2)], state({("a", "law"): 1, ("a", "med"): 1}), set(), {"a"}),
    ("an engine whose adapters all fit its slots: never full",
     [slot("a", slots=2, adapters=("fin", "law"))], state({("a", "law"): 1, ("a", "med"): 1}), set(), set()),
    # The fleet's slots as one budget: live adapters, and those that ran within recent_s.
    ("live with room, no slot to spare in the fleet (one that ran lately needs it): no other engine",
     [slot("a"), slot("b")],
     state({("a", "fin"): 3, ("a", "law"): 1, ("b", "med"): 1}, used={("b", "tax"): NOW - 20}), {"a"}, {"b"}),
    ("... unless its engine reports itself overloaded (KV cache nearly full): it queues there anyway",
     [slot("a", kv=0.95), slot("b")],
     state({("a", "fin"): 3, ("a", "law"): 1, ("b", "med"): 1}, used={("b", "tax"): NOW - 20}), {"a"}, set()),
    ("... or at its sequence slots",
     [slot("a", running=64), slot("b")],
     state({("a", "fin"): 3, ("a", "law"): 1, ("b", "med"): 1}, used={("b", "tax"): NOW - 20}), {"a"}, set()),
    ("... with a slot to spare, a hot adapter may take another engine",
     [slot("a"), slot("b")], state({("a", "fin"): 3, ("a", "law"): 1, ("b", "med"): 1}), {"a"}, set()),
    ("... watching for less than recent_s: every adapter the engines serve counts as in demand",
     [slot("a"), slot("b")], state({("a", "fin"): 3, ("a", "law"): 1, ("b", "med"): 1}, watching_s=5), {"a"}, {"b"}),
    ("live on two engines while the fleet is short: one keeps it (most in flight), the other is full",
     [slot("a"), slot("b")],
     state({("a", "fin"): 2, ("a", "law"): 1, ("b", "fin"): 1, ("b", "med"): 1}, used={("a", "tax"): NOW - 20}),
     {"a"}, {"b"}),
    ("... one where it has room before one with more adapters than slots",
     [slot("a"), slot("b")],
     state({("a", "fin"): 3, ("a", "law"): 1, ("a", "med"): 1, ("b", "fin"): 1, ("b", "tax"): 1}), {"b"}, {"a"}),
    ("... both crowded: the one with the most in flight (the other copy drains first)",
     [slot("a"), slot("b")],
     state({("a", "fin"): 1, ("a", "law"): 1, ("a", "med"): 1, ("b", "fin"): 3, ("b", "tax"): 1, ("b", "law"): 1}),
     {"b"}, {"a", "b"}),
    ("... both stay warm while the one it would keep reports itself overloaded",
     [slot("a", kv=0.95), slot("b")],
     state({("a", "fin"): 2, ("a", "law"): 1, ("b", "fin"): 1, ("b", "med"): 1}, used={("a", "tax"): NOW - 20}),
     {"a", "b"}, set()),
    ("live on two engines with the fleet's slots enough for every copy: both stay warm",
     [slot("a", slots=3), slot("b", slots=3)],
     state({("a", "fin"): 2, ("a", "law"): 1, ("b", "fin"): 1, ("b", "med"): 1}), {"a", "b"}, set()),
]


@pytest.mark.parametrize(("why", "slots", "st", "warm", "full"), CASES, ids=[c[0] for c in CASES])
def test_residency_table(why: str, slots: list[Slot], st: LoraState, warm: set[str], full: set[str]) -> None:
    assert residency(slots, "fin", st, NOW) == (frozenset(warm), frozenset(full))


@pytest.mark.parametrize(
    ("why", "slots", "st", "spare"),
    [
        ("the slots, less the adapters live on each engine (a copy on each counts twice)",
         [slot("a", slots=3), slot("b", slots=3)], state({("a", "fin"): 1, ("a", "law"): 1, ("b", "fin"): 1}), 3),
        ("... and less those that ran within recent_s and are live nowhere now",
         [slot("a", slots=3), slot("b", slots=3)],
         state({("a", "fin"): 1}, used={("b", "law"): NOW - 20, ("a", "med"): NOW - 40}), 4),
        ("... every adapter the engines serve while the gateway has watched for less than recent_s",
         [slot("a", slots=3), slot("b", slots=3)], state({("a", "fin"): 1}, watching_s=5), 2),
        ("an engine with unknown slots: no budget", [slot("a", slots=0), slot("b")], state(), math.inf),
        ("an engine whose adapters all fit its slots: no budget",
         [slot("a", adapters=("fin",)), slot("b")], state(), math.inf),
    ],
)
def test_fleet_spare(why: str, slots: list[Slot], st: LoraState, spare: float) -> None:
    lives = {s.id: live_adapters(s, {a for (w, a) in st.local if w == s.id}, st.last_used) for s in slots}
    assert fleet_spare(slots, lives, st, NOW) == spare


@pytest.mark.parametrize(
    ("why", "worker", "st", "holders"),
    [
        ("every slot live with others: a slot wait, by how many hold them",
         slot("a", active=("law",)), state({("a", "med"): 1}), 2),
        ("the adapter is live there: it runs beside them", slot("a"), state({("a", "fin"): 1, ("a", "law"): 1}), 0),
        ("a slot is free", slot("a"), state({("a", "law"): 1}), 0),
        ("a report made before the gateway finished with an adapter there no longer counts it",
         slot("a", active=("law", "med"), report_at=NOW - 2.0), state(used={("a", "law"): NOW - 1.0}), 0),
        ("slots unknown: never counted", slot("a", slots=0), state({("a", "law"): 1, ("a", "med"): 1}), 0),
    ],
)
def test_slot_wait(why: str, worker: Slot, st: LoraState, holders: int) -> None:
    assert slot_wait(worker, "fin", st) == holders


HOLD_CASES = [
    ("an idle adapter that ran within hold_s keeps its slot while another engine has one free",
     state({("a", "law"): 1}, used={("a", "med"): NOW - 3}), set(), {"a"}),
    ("... and gives it up when no engine has a free slot that is not held",
     state({("a", "law"): 1, ("b", "law"): 1}, used={("a", "med"): NOW - 3, ("b", "tax"): NOW - 3}),
     set(), set()),
    ("a slot held longer ago than hold_s (10 s) is free",
     state({("a", "law"): 1, ("b", "law"): 1}, used={("a", "med"): NOW - 11}), set(), set()),
    ("the adapter's own hold is its own slot: it goes back there",
     state({("a", "law"): 1}, used={("a", "fin"): NOW - 3}), {"a"}, set()),
]


@pytest.mark.parametrize(("why", "st", "warm", "full"), HOLD_CASES, ids=[c[0] for c in HOLD_CASES])
def test_idle_adapters_hold_their_slots(why: str, st: LoraState, warm: set[str], full: set[str]) -> None:
    assert residency([slot("a"), slot("b")], "fin", st, NOW) == (frozenset(warm), frozenset(full))


def test_a_hot_adapter_never_takes_a_held_slot_for_an_extra_engine() -> None:
    """Live (with room) on a: b's only free slot is held by an idle adapter, so b stays full for
    it (a spill there would leave that adapter waiting when it comes back)."""
    st = state({("a", "fin"): 5, ("b", "law"): 1}, used={("b", "med"): NOW - 3})
    assert residency([slot("a"), slot("b")], "fin", st, NOW) == (frozenset({"a"}), frozenset({"b"}))


HEAVY_CASES = [
    # (what it shows, workers (8 slots: the fleet has slots to spare), state, warm, full)
    ("a light adapter live with room takes no other engine (a copy would cost a slot and a prefix cache)",
     [slot("a", slots=8), slot("b", slots=8)], state({("a", "fin"): 2, ("a", "law"): 9}), {"a"}, {"b"}),
    ("a heavy one (heavy_share, 0.3, of the requests in flight where it is live) may",
     [slot("a", slots=8), slot("b", slots=8)], state({("a", "fin"): 4, ("a", "law"): 6}), {"a"}, set()),
    ("a light one may while its engine reports itself overloaded (it queues there anyway)",
     [slot("a", slots=8, kv=0.95), slot("b", slots=8)], state({("a", "fin"): 2, ("a", "law"): 9}), {"a"}, set()),
    ("the other replicas' requests count too",
     [slot("a", slots=8), slot("b", slots=8)], state({("a", "fin"): 2}, remote={("a", "law"): 9}), {"a"}, {"b"}),
    ("warm only where it last ran (nothing in flight): its first request back goes as before",
     [slot("a", slots=8), slot("b", slots=8)], state({("a", "law"): 9}, used={("a", "fin"): NOW - 5}), {"a"},
     set()),
]


@pytest.mark.parametrize(("why", "slots", "st", "warm", "full"), HEAVY_CASES, ids=[c[0] for c in HEAVY_CASES])
def test_only_a_heavy_adapter_takes_another_engine(why: str, slots: list[Slot], st: LoraState, warm: set[str],
                                                   full: set[str]) -> None:
    assert residency(slots, "fin", st, NOW) == (frozenset(warm), frozenset(full))


@pytest.mark.parametrize(("last_used", "want"), [
    ({}, {"fin", "law"}),  # no gateway used them since: the report stands
    ({"law": NOW - 2.0}, {"fin", "law"}),  # used before the report: it saw that request run
    ({"law": NOW}, {"fin"}),  # sent or finished after the report: it ended (or is counted in flight)
    ({"fin": NOW, "law": NOW}, set()),
])
def test_a_report_names_an_adapter_running_until_a_gateway_used_it_since(
    last_used: dict[str, float], want: set[str],
) -> None:
    """The engine's report (1 s old) names fin and law running; what an eviction and routing take
    as running there (the gateways' in-flight counts cover what they sent since)."""
    got = still_reported("a", ("fin", "law"), NOW - 1.0, lambda w, a: last_used.get(a, 0.0))
    assert got == want
