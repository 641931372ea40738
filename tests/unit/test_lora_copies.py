"""An adapter live on several engines (gateway/routing/fleet.py `_copy_pick`): its requests go to
its primary, the first of those engines in the adapter's ring order, and to another copy only
while the primary is clearly busier, so the copies a burst made drain when it is over (issue 36,
3 x 8 on the H100: every engine saw 8 distinct adapters where the adapter-affine client's saw 5-6)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetgate.hashing import stable_hash
from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.routing import Live, RequestFacts, Routes, decide, make_policy

POLICY = make_policy("fleet")  # lora_load_cost 0.3: a copy is made at 0.3 busier, kept at 0.15
KEY = stable_hash("adapter\0fin")
NONE: frozenset[str] = frozenset()


def engine(wid: str, max_loras: int = 2) -> WorkerView:
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="vllm", model="base", adapters=("fin", "law", "med"),
                        capacity=100, max_loras=max_loras),
        state="ready", load=Load(lora_slots=max_loras), id_hash=stable_hash(wid),
    )


# The engines in the adapter's ring order: PRIMARY is its primary wherever it is live, then COPY, OTHER.
_RING = Routes.build(tuple(engine(w) for w in ("w0", "w1", "w2"))).by_model["fin"].ring_order(KEY)
PRIMARY, COPY, OTHER = (s.id for s in _RING)


def pick(busy: dict[str, int], warm: frozenset[str], full: frozenset[str] = NONE, *, seq: int = 0,
         reverse: bool = False) -> tuple[str, str]:
    """The first choice for a `fin` request; `busy`: each engine's requests in flight (of 100)."""
    fleet = tuple(engine(w) for w in sorted(busy, reverse=reverse))
    f = RequestFacts("fin", adapter=True, warm=warm, full=full, affinity_key=KEY, affinity_kind="adapter", seq=seq)
    choice = decide(Routes.build(fleet), f, Live(busy), POLICY).choices[0]
    return choice.worker.id, choice.reason


BOTH = frozenset({PRIMARY, COPY})
COPY_CASES = [
    # (what it shows, requests in flight per engine, warm (live there), full, first choice, reason)
    ("the copy drains: with the loads equal every request goes to the primary",
     {PRIMARY: 20, COPY: 20}, BOTH, NONE, PRIMARY, "adapter-warm"),
    ("... and while the copy is less loaded by under half lora_load_cost",
     {PRIMARY: 34, COPY: 20}, BOTH, NONE, PRIMARY, "adapter-warm"),
    ("... and while the copy is the busier one",
     {PRIMARY: 40, COPY: 60}, BOTH, NONE, PRIMARY, "adapter-warm"),
    ("the copy is kept while the primary is busier by half lora_load_cost",
     {PRIMARY: 40, COPY: 20}, BOTH, NONE, COPY, "adapter-share"),
    ("hysteresis: the same gap makes no new copy on an engine with a free slot",
     {PRIMARY: 40, COPY: 20}, frozenset({PRIMARY}), NONE, PRIMARY, "adapter-warm"),
    ("... a new copy only at the whole lora_load_cost (the spill, as before)",
     {PRIMARY: 55, COPY: 20}, frozenset({PRIMARY}), NONE, COPY, "adapter-spill"),
    ("a saturated primary shares with a copy that is not, however close their loads",
     {PRIMARY: 100, COPY: 95}, BOTH, NONE, COPY, "adapter-share"),
    ("of several copies, the least loaded shares the primary's load",
     {PRIMARY: 50, COPY: 30, OTHER: 10}, frozenset({PRIMARY, COPY, OTHER}), NONE, OTHER, "adapter-share"),
    ("a copy on an engine with more adapters than slots is no copy: the primary keeps it",
     {PRIMARY: 50, COPY: 0}, BOTH, frozenset({COPY}), PRIMARY, "adapter-warm"),
    ("live on the primary's ring successor alone, it stays there (no move to the ring's first)",
     {PRIMARY: 0, COPY: 20}, frozenset({COPY}), frozenset({PRIMARY}), COPY, "adapter-warm"),
]


@pytest.mark.parametrize(("why", "busy", "warm", "full", "first_id", "reason"), COPY_CASES,
                         ids=[c[0] for c in COPY_CASES])  # fmt: skip
def test_copy_table(why: str, busy: dict[str, int], warm: frozenset[str], full: frozenset[str], first_id: str,
                    reason: str) -> None:
    assert pick(busy, warm, full) == (first_id, reason)
    assert pick(busy, warm, full, reverse=True) == (first_id, reason), "listed in another order"


def test_hysteresis_over_a_burst() -> None:
    """The primary's load rising then falling past the copy's (20 in flight): the copy is made at
    0.3 busier, takes requests down to 0.15 busier, then none (it drains); the gap at which it
    was made does not make another."""
    rising = [pick({PRIMARY: n, COPY: 20}, frozenset({PRIMARY}))[1] for n in (30, 40, 49, 51, 60)]
    assert rising == ["adapter-warm", "adapter-warm", "adapter-warm", "adapter-spill", "adapter-spill"]
    falling = [pick({PRIMARY: n, COPY: 20}, BOTH)[1] for n in (60, 45, 36, 34, 30, 20)]
    assert falling == ["adapter-share", "adapter-share", "adapter-share", "adapter-warm", "adapter-warm",
                       "adapter-warm"]


@settings(max_examples=200, deadline=None)
@given(busy=st.tuples(st.integers(0, 100), st.integers(0, 100), st.integers(0, 100)),
       live=st.sets(st.integers(0, 2), min_size=1), seqs=st.tuples(st.integers(0, 2**32), st.integers(0, 2**32)))
def test_replicas_agree_on_the_copy(busy: tuple[int, int, int], live: set[int], seqs: tuple[int, int]) -> None:
    """Two replicas (their own request counters, the engines listed in either order) that see the
    same loads send an adapter live on any of the engines to the same one, for the same reason."""
    ids = (PRIMARY, COPY, OTHER)
    load = dict(zip(ids, busy, strict=True))
    warm = frozenset(ids[i] for i in live)
    assert pick(load, warm, seq=seqs[0]) == pick(load, warm, seq=seqs[1], reverse=True)
