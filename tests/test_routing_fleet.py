"""The `fleet` policy over hand-built snapshots: affinity, bounded load, capacity, consistency."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetgate.hashing import stable_hash
from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.routing import FleetOptions, RequestFacts, Routes, decide, make_policy
from gateway.routing.fleet import FleetPolicy
from gateway.routing.table import Slot


def w(wid: str, *, capacity: int = 100, running: int = 0, waiting: int = 0, kv: float = 0.0,
      adapters: tuple[str, ...] = (), speed: float = 1.0) -> WorkerView:
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="sim", model="base", capacity=capacity,
                        adapters=adapters, speed=speed),
        state="ready",
        load=Load(running=running, waiting=waiting, kv_cache_usage=kv),
        id_hash=stable_hash(wid),
    )


POLICY = make_policy("fleet")
KEY = stable_hash("system prompt A")


def facts(key: int | None = KEY, kind: str = "prefix", seq: int = 0) -> RequestFacts:
    return RequestFacts("base", affinity_key=key, affinity_kind=kind if key is not None else None, seq=seq)


def first(fleet: tuple[WorkerView, ...], f: RequestFacts, inflight: dict[str, int] | None = None) -> tuple[str, str]:
    choice = decide(Routes.build(fleet), f, inflight or {}, POLICY).choices[0]
    return choice.worker.id, choice.reason


def home_of(key: int, ids: list[str]) -> str:
    fleet = tuple(w(i) for i in ids)
    return first(fleet, facts(key))[0]


def test_same_prefix_goes_to_the_same_worker_while_load_allows() -> None:
    """Requests sharing a prefix land on one worker (a prefix-cache hit), whatever their order."""
    fleet = (w("a"), w("b"), w("c"), w("d"))
    homes = {first(fleet, facts(seq=i))[0] for i in range(20)}
    assert len(homes) == 1
    assert first(fleet, facts())[1] == "prefix-hit"


def test_different_prefixes_spread_over_the_fleet() -> None:
    """Many distinct prefixes use every worker, roughly evenly."""
    fleet = (w("a"), w("b"), w("c"), w("d"))
    counts = Counter(first(fleet, facts(stable_hash(f"p{i}")))[0] for i in range(400))
    assert set(counts) == {"a", "b", "c", "d"}
    assert min(counts.values()) > 60


CASES = [
    # (what it shows, loads of a/b/c {id: (running, waiting, kv)}, inflight, expected reason)
    ("an idle home takes its prefix", {}, {}, "prefix-hit"),
    ("a home far above its fair share spills to the next in rendezvous order",
     {"HOME": (90, 0, 0.5)}, {}, "prefix-spill"),
    ("a home with a queue and a full KV cache is saturated and skipped",
     {"HOME": (10, 3, 0.95)}, {}, "prefix-spill"),
    ("gateway in-flight counts even before the engine reports it", {}, {"HOME": 60}, "prefix-spill"),
    ("a little extra load on the home keeps affinity (slack)", {"HOME": (2, 0, 0.1)}, {}, "prefix-hit"),
]


@pytest.mark.parametrize(("why", "loads", "inflight", "reason"), CASES, ids=[c[0] for c in CASES])
def test_bounded_load_table(why: str, loads: dict[str, tuple[int, int, float]], inflight: dict[str, int],
                            reason: str) -> None:
    ids = ["a", "b", "c"]
    home = home_of(KEY, ids)
    fleet = tuple(
        w(i, running=loads.get("HOME", (0, 0, 0.0))[0] if i == home else 0,
          waiting=loads.get("HOME", (0, 0, 0.0))[1] if i == home else 0,
          kv=loads.get("HOME", (0, 0, 0.0))[2] if i == home else 0.0)
        for i in ids
    )
    mapped = {home if k == "HOME" else k: v for k, v in inflight.items()}
    chosen, why_chosen = first(fleet, facts(), mapped)
    assert why_chosen == reason
    assert (chosen == home) == (reason == "prefix-hit")


def test_without_affinity_the_least_loaded_by_capacity_wins() -> None:
    """Load is normalised by capacity: 40 running on a 256-seat card beats 20 on a 32-seat card."""
    fleet = (w("big", capacity=256, running=40), w("small", capacity=32, running=20))
    assert first(fleet, facts(None)) == ("big", "least-load")


def test_a_slow_card_counts_for_less_than_its_batch() -> None:
    """Capacity is batch x speed: a T4-class card (speed 0.25) with 4 of 64 seats taken is
    busier than an H100-class one with 12 of 64, and is home to fewer prefixes."""
    fleet = (w("fast", capacity=64, running=12), w("slow", capacity=64, running=4, speed=0.25))
    assert first(fleet, facts(None)) == ("fast", "least-load")
    assert first((w("fast", capacity=64, running=12), w("slow", capacity=64, running=4)), facts(None))[0] == "slow"
    idle = (w("fast", capacity=64), w("slow", capacity=64, speed=0.25))
    homes = Counter(first(idle, facts(stable_hash(f"p{i}")))[0] for i in range(400))
    assert homes["slow"] < homes["fast"] / 2


def test_kv_pressure_and_queue_outweigh_a_low_running_count() -> None:
    """A worker with a queue and a nearly full KV cache is avoided even if it runs fewer requests."""
    fleet = (w("pressed", running=5, waiting=8, kv=0.98), w("calm", running=30, kv=0.4))
    assert first(fleet, facts(None))[0] == "calm"


def test_adapter_requests_report_adapter_resident() -> None:
    """Without an affinity key an adapter request says it went where the adapter is resident."""
    fleet = (w("a", adapters=("fin",)),)
    f = RequestFacts("fin", adapter=True)
    assert decide(Routes.build(fleet), f, {}, POLICY).choices[0].reason == "adapter-resident"


def test_every_candidate_is_ranked_once_for_retries() -> None:
    """The ranking lists every eligible worker exactly once, so retries can walk it."""
    fleet = tuple(w(f"w{i}", running=i) for i in range(6))
    ranked = [c.worker.id for c in decide(Routes.build(fleet), facts(), {}, POLICY, limit=6).choices]
    assert sorted(ranked) == sorted(x.id for x in fleet)


def test_options_come_from_config() -> None:
    """Routing knobs reach the policy from the gateway's config."""
    policy = make_policy("fleet", {"balance": 0.5, "slack": 0})
    assert isinstance(policy, FleetPolicy)
    assert policy.opts == FleetOptions(balance=0.5, slack=0)


# -- properties -----------------------------------------------------------------------

loads = st.lists(
    st.tuples(st.integers(0, 200), st.integers(0, 50), st.floats(0, 1), st.sampled_from([16, 64, 256])),
    min_size=1, max_size=12,
)


def build(spec: list[tuple[int, int, float, int]]) -> tuple[WorkerView, ...]:
    return tuple(w(f"w{i}", running=r, waiting=q, kv=kv, capacity=c) for i, (r, q, kv, c) in enumerate(spec))


@settings(max_examples=200, deadline=None)
@given(spec=loads, key=st.integers(0, 2**64 - 1))
def test_replicas_agree_given_the_same_snapshot(spec: list[tuple[int, int, float, int]], key: int) -> None:
    """Two gateway replicas (two policy objects, workers listed in any order) choose the same worker."""
    fleet = build(spec)
    one = decide(Routes.build(fleet), facts(key), {}, make_policy("fleet")).choices[0].worker.id
    two = decide(Routes.build(tuple(reversed(fleet))), facts(key), {}, make_policy("fleet")).choices[0].worker.id
    assert one == two


@settings(max_examples=200, deadline=None)
@given(spec=loads, key=st.integers(0, 2**64 - 1))
def test_affinity_never_exceeds_the_load_bound(spec: list[tuple[int, int, float, int]], key: int) -> None:
    """A worker chosen for affinity carries at most (1 + balance) x its fair share + slack,
    measured in its KV-aware capacity."""
    fleet = build(spec)
    opts = FleetOptions()
    choice = decide(Routes.build(fleet), facts(key), {}, make_policy("fleet")).choices[0]
    if choice.reason.startswith("prefix"):
        total = sum(x.load.running + x.load.waiting for x in fleet) + 1
        capacity = sum(Slot(x).weight for x in fleet)
        chosen = choice.worker
        limit = (1 + opts.balance) * total / capacity * Slot(chosen).weight + opts.slack
        assert chosen.load.running + chosen.load.waiting + 1 <= limit


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 16), key=st.integers(0, 2**64 - 1))
def test_a_worker_leaving_moves_only_its_own_keys(n: int, key: int) -> None:
    """Rendezvous hashing: removing a worker that is not a key's home leaves that key where it was."""
    ids = [f"w{i}" for i in range(n)]
    home = home_of(key, ids)
    other = next(i for i in ids if i != home)
    assert home_of(key, [i for i in ids if i != other]) == home


def aw(wid: str, active: tuple[str, ...], max_loras: int = 2, running: int = 0) -> WorkerView:
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="vllm", model="base", adapters=("fin", "law", "med"),
                        capacity=100, runtime_lora=True, max_loras=max_loras),
        state="ready", load=Load(running=running, lora_active=active), id_hash=stable_hash(wid),
    )


ADAPTER_CASES = [
    # (what it shows, fleet, warm workers, full workers, expected first choice, reason)
    ("an adapter goes where it is already in a slot",
     (aw("a", ()), aw("b", ("fin",))), frozenset(), frozenset(), "b", "adapter-warm"),
    ("recently routed here by this gateway counts as warm before the engine reports it",
     (aw("a", ()), aw("b", ())), frozenset({"a"}), frozenset(), "a", "adapter-warm"),
    ("a free slot beats evicting another adapter",
     (aw("a", ("law", "med")), aw("b", ("law",))), frozenset(), frozenset(), "b", "adapter-resident"),
    ("slots this gateway filled count as taken though the engine shows none in use",
     (aw("a", ()), aw("b", ("law",))), frozenset(), frozenset({"a"}), "b", "adapter-resident"),
    ("load still wins when the warm worker is far busier",
     (aw("a", (), running=5), aw("b", ("fin",), running=95)), frozenset(), frozenset(), "a", "adapter-resident"),
]


@pytest.mark.parametrize(("why", "fleet", "warm", "full", "first_id", "reason"), ADAPTER_CASES,
                         ids=[c[0] for c in ADAPTER_CASES])  # fmt: skip
def test_adapter_placement_table(why: str, fleet: tuple[WorkerView, ...], warm: frozenset[str],
                                 full: frozenset[str], first_id: str, reason: str) -> None:  # fmt: skip
    f = RequestFacts("fin", adapter=True, warm=warm, full=full)
    choice = decide(Routes.build(fleet), f, {}, POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == (first_id, reason)
