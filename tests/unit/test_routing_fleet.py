"""The `fleet` policy over hand-built snapshots: affinity, bounded load, capacity, consistency."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetgate.hashing import stable_hash
from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.routing import FleetOptions, FullAt, Live, RequestFacts, Routes, decide, make_policy
from gateway.routing.fleet import FleetPolicy
from gateway.routing.homes import Homes
from gateway.routing.table import Slot
from gateway.settings import load_settings


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


def route(fleet: tuple[WorkerView, ...], homes: Homes, key: int, *, now: float = 0.0, prefix: int = 0,
          live: Live | None = None, seq: int = 0) -> tuple[str, str]:
    """One decision as the gateway makes it: look the key up, decide, record the placement."""
    entry = homes.get(key)
    f = RequestFacts("base", affinity_key=key, affinity_kind="prefix", seq=seq, prefix_tokens=prefix,
                     home=entry.home if entry else None, second=entry.live_second(now) if entry else None)
    base = live or Live({})
    choice = decide(Routes.build(fleet), f, Live(base.requests, base.tokens, homes), POLICY).choices[0]
    if choice.reason.endswith("-placed"):
        homes.place(key, choice.worker.id, "base", prefix, 100, now)
    elif choice.reason.endswith("-spill"):
        homes.spill(key, choice.worker.id, now)
    homes.note(key, choice.worker.id, 100.0, 100, now)
    return choice.worker.id, choice.reason


def test_same_prefix_goes_to_the_same_worker_while_load_allows() -> None:
    """Requests sharing a prefix land on one worker (a prefix-cache hit), whatever their order."""
    fleet = (w("a"), w("b"), w("c"), w("d"))
    homes = Homes()
    picks = [route(fleet, homes, KEY, seq=i) for i in range(20)]
    assert len({wid for wid, _ in picks}) == 1
    assert picks[0][1] == "prefix-placed"
    assert {why for _, why in picks[1:]} == {"prefix-hit"}


def test_different_prefixes_spread_over_the_fleet() -> None:
    """Many distinct prefixes use every worker, roughly evenly."""
    fleet = (w("a"), w("b"), w("c"), w("d"))
    counts = Counter(first(fleet, facts(stable_hash(f"p{i}")))[0] for i in range(400))
    assert set(counts) == {"a", "b", "c", "d"}
    assert min(counts.values()) > 60


def test_equal_tenants_are_partitioned_evenly() -> None:
    """16 tenants of equal traffic on two workers: 8 each (a hash ring put 10 on one), and
    every later request of a tenant goes to its home."""
    fleet = (w("a"), w("b"))
    homes = Homes()
    keys = [stable_hash(f"tenant-{i}") for i in range(16)]
    for rnd in range(5):
        for i, key in enumerate(keys):
            route(fleet, homes, key, now=rnd, seq=rnd * 16 + i)
    placed = Counter(homes.get(k).home for k in keys)  # type: ignore[union-attr]
    assert placed == {"a": 8, "b": 8}
    assert all(route(fleet, homes, k, now=5)[1] == "prefix-hit" for k in keys)


def kvw(wid: str, *, kv_tokens: int = 0, running: int = 0, waiting: int = 0, kv: float = 0.0,
        capacity: int = 100) -> WorkerView:
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="sim", model="base", capacity=capacity,
                        kv_tokens=kv_tokens),
        state="ready", load=Load(running=running, waiting=waiting, kv_cache_usage=kv), id_hash=stable_hash(wid),
    )


CASES = [
    # (what it shows, engine loads {id: (running, waiting, kv)}, kv_tokens of each worker,
    #  gateway account {id: (requests, tokens)}, second home, heavy key?, expected (worker, reason))
    ("a placed key goes home while its home has room",
     {}, 0, {}, None, True, ("a", "prefix-hit")),
    ("a second-old engine queue alone does not move a key (the herding of issue 14)",
     {"a": (50, 5, 0.6)}, 0, {}, None, True, ("a", "prefix-hit")),
    ("a heavy key whose home is at its sequence slots by the account spills to a worker with room",
     {}, 0, {"a": (100, 0)}, None, True, ("b", "prefix-spill")),
    ("a light key stays home though its home is saturated (no tenant scatter, no thrash)",
     {}, 0, {"a": (100, 0)}, None, False, ("a", "prefix-hit")),
    ("a heavy key whose home is at kv_high of its declared KV cache by the account spills",
     {}, 10_000, {"a": (20, 9_500)}, None, True, ("b", "prefix-spill")),
    ("where the KV size is unknown, an engine queue with a nearly full cache is saturation",
     {"a": (20, 3, 0.95)}, 0, {}, None, True, ("b", "prefix-spill")),
    ("a spill needs a worker clearly less loaded than the saturated home",
     {}, 0, {"a": (100, 0), "b": (97, 0)}, None, True, ("a", "prefix-hit")),
    ("when every worker is saturated the key stays where its prefix is cached",
     {}, 0, {"a": (100, 0), "b": (100, 0), "c": (100, 0)}, None, True, ("a", "prefix-hit")),
    ("a key with a second home goes to the less loaded of its two homes",
     {}, 0, {"a": (30, 0)}, "b", True, ("b", "prefix-spill")),
    ("...and back home when the home is the lighter one",
     {}, 0, {"b": (30, 0)}, "b", True, ("a", "prefix-hit")),
]


@pytest.mark.parametrize(("why", "loads", "kv_tokens", "account", "second", "heavy", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_home_and_spill_table(why: str, loads: dict[str, tuple[int, int, float]], kv_tokens: int,
                              account: dict[str, tuple[int, int]], second: str | None, heavy: bool,
                              expected: tuple[str, str]) -> None:
    fleet = tuple(kvw(i, kv_tokens=kv_tokens, running=loads.get(i, (0, 0, 0.0))[0],
                      waiting=loads.get(i, (0, 0, 0.0))[1], kv=loads.get(i, (0, 0, 0.0))[2]) for i in ("a", "b", "c"))
    account = {"c": (95, 0), **account}  # a busy third worker: never the lightest
    live = Live({k: v[0] for k, v in account.items()}, {k: v[1] for k, v in account.items()})
    f = RequestFacts("base", affinity_key=KEY, affinity_kind="prefix", home="a", second=second, heavy=heavy)
    choice = decide(Routes.build(fleet), f, live, POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == expected


def test_a_new_key_goes_where_least_work_is_placed_and_its_prefix_fits() -> None:
    """Placement: the least placed work per unit of capacity, skipping a worker whose cache
    cannot hold the prefix beside the keys already placed there."""
    fleet = (kvw("a", kv_tokens=10_000), kvw("b", kv_tokens=10_000), kvw("c", kv_tokens=10_000))
    f = RequestFacts("base", affinity_key=KEY, affinity_kind="prefix", prefix_tokens=2_000)
    homes = Homes(placed={"a": 500.0, "b": 100.0, "c": 300.0}, prefixes={"b": 8_000.0})
    live = Live({}, {}, homes)
    choice = decide(Routes.build(fleet), f, live, POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == ("c", "prefix-placed")


def test_rebalance_moves_a_cold_key_off_the_worker_with_the_hot_one() -> None:
    """One hot tenant (40% of the work) and 15 cold ones placed 8/8: the hot tenant's worker
    hands cold keys to the other until the gap is under `balance`; the hot key stays put;
    a balanced table moves nothing (hysteresis)."""
    fleet = (w("a"), w("b"))
    routes = Routes.build(fleet)
    homes = Homes(imbalance=0.25, half_life_s=1e9)
    hot = stable_hash("hot")
    homes.place(hot, "a", "base", 1500, 2000, 0.0)
    homes.note(hot, "a", 40.0, 2000, 0.0)  # 40% of all the work: the cold ones do 60
    for i in range(15):
        key = stable_hash(f"cold-{i}")
        homes.place(key, "a" if i < 7 else "b", "base", 1500, 2000, 0.0)
        homes.note(key, "a" if i < 7 else "b", 4.0, 2000, 0.0)
    moves = []
    for t in range(1, 12):
        moves += homes.rebalance(routes.by_model, float(t))
    assert moves and all(src == "a" and dst == "b" and key != hot for key, src, dst in moves)
    assert homes.get(hot).home == "a"  # type: ignore[union-attr]
    gap = abs(homes.placed["a"] - homes.placed["b"]) / ((homes.placed["a"] + homes.placed["b"]) / 2)
    assert gap <= 0.25
    assert homes.rebalance(routes.by_model, 13.0) == []


def test_keys_of_a_worker_that_left_are_placed_again() -> None:
    """A worker leaving (or draining) drops its keys' homes; their next requests are placed anew."""
    homes = Homes()
    key = stable_hash("k")
    homes.place(key, "gone", "base", 100, 200, 0.0)
    homes.note(key, "gone", 10.0, 200, 0.0)
    homes.rebalance(Routes.build((w("a"), w("b"))).by_model, 1.0)
    assert homes.get(key) is None
    assert route((w("a"), w("b")), homes, key, now=1.0)[1] == "prefix-placed"


def test_a_second_home_expires_after_its_hold() -> None:
    """Hysteresis: a spill gives the key a second home for `second_hold_s`, then it is forgotten."""
    homes = Homes(second_hold_s=10.0)
    key = stable_hash("k")
    homes.place(key, "a", "base", 100, 200, 0.0)
    homes.spill(key, "b", 5.0)
    assert homes.get(key).live_second(14.0) == "b"  # type: ignore[union-attr]
    assert homes.get(key).live_second(15.5) is None  # type: ignore[union-attr]


SHED_CASES = [
    # (what it shows, kv_tokens, engine (running, waiting, kv), account (requests, tokens), full?)
    ("an idle worker is never full, whatever its second-old gauges said", 0, (200, 300, 1.0), (0, 0), None),
    ("requests at capacity x (1 + queue_ratio) by the account", 0, (0, 0, 0.0), (200, 0), "slots"),
    ("KV tokens at the cache x (1 + queue_ratio) by the account", 10_000, (0, 0, 0.0), (50, 20_000), "kv"),
    ("under that, with KV declared, the engine's queue does not count", 10_000, (100, 50, 1.0), (50, 9_000), None),
    ("KV size unknown: at capacity by the account and the engine queues with a full cache",
     0, (100, 5, 0.99), (100, 0), "kv"),
]


@pytest.mark.parametrize(("why", "kv_tokens", "engine", "account", "expected"), SHED_CASES,
                         ids=[c[0] for c in SHED_CASES])
def test_load_shedding_table(why: str, kv_tokens: int, engine: tuple[int, int, float],
                             account: tuple[int, int], expected: str | None) -> None:
    slot = Slot(kvw("a", kv_tokens=kv_tokens, running=engine[0], waiting=engine[1], kv=engine[2]))
    assert FullAt().why(slot, Live({"a": account[0]}, {"a": account[1]})) == expected


HOLD_CASES = [
    # (what it shows, kv_tokens, account (requests, tokens), this request's tokens, hold_kv, holds?)
    ("room in the cache by the account: no hold", 10_000, (10, 5_000), 200, 0.9, False),
    ("this request would take the cache past hold_kv: hold", 10_000, (10, 8_900), 200, 0.9, True),
    ("exactly at the line is not past it", 10_000, (10, 8_800), 200, 0.9, False),
    ("nothing in flight there: no completion would make room, so never hold", 10_000, (0, 0), 20_000, 0.9, False),
    ("KV size unknown: never hold", 0, (10, 8_900), 200, 0.9, False),
    ("hold_kv 0 turns it off", 10_000, (10, 9_900), 200, 0.0, False),
]


@pytest.mark.parametrize(("why", "kv_tokens", "account", "tokens", "hold_kv", "expected"), HOLD_CASES,
                         ids=[c[0] for c in HOLD_CASES])
def test_kv_hold_table(why: str, kv_tokens: int, account: tuple[int, int], tokens: int, hold_kv: float,
                       expected: bool) -> None:
    slot = Slot(kvw("a", kv_tokens=kv_tokens))
    live = Live({"a": account[0]}, {"a": account[1]})
    assert FullAt(hold_kv=hold_kv).holds(slot, live, tokens) is expected


def measured(wid: str, *, kv_tokens: int = 33_696, running: int = 0, waiting: int = 0, kv: float = 0.0,
             capacity: int = 1024, unhealthy: str = "") -> WorkerView:
    """A worker whose engine reported its KV use in its last scrape (vLLM, the simulator, LMDeploy)."""
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="vllm", model="base", capacity=capacity,
                        kv_tokens=kv_tokens),
        state="ready", id_hash=stable_hash(wid),
        load=Load(running=running, waiting=waiting, kv_cache_usage=kv, kv_measured=True, unhealthy=unhealthy,
                  ts=1.0),
    )


# Issue 31's fleet: 33,696 KV tokens an engine, 16 tenants with 1,500-token prompts.
MEASURED_SHED_CASES = [
    # (what it shows, engine (running, waiting, kv), account (requests, tokens), fresh tokens, full?)
    ("the engine reports an empty queue and half its KV free: not full, whatever the budgets sent say",
     (30, 0, 0.43), (30, 130_000), 0, None),
    ("max_tokens 4096 on 64-token answers: the account's budgets (3x the cache) count for nothing",
     (60, 0, 0.5), (60, 60 * 4_161), 2_000, None),
    ("sent since the report fills a cache the engine half uses, and as much again: full",
     (30, 0, 0.5), (200, 0), 52_000, "kv"),
    ("a full cache and a queue longer than its batch: full",
     (40, 45, 0.99), (85, 0), 0, "kv"),
    ("a full cache with a short queue is the engine's to absorb: not full",
     (40, 2, 0.99), (42, 0), 0, None),
    ("sequence slots by the account still count",
     (10, 0, 0.1), (2 * 1024, 0), 0, "slots"),
]


@pytest.mark.parametrize(("why", "engine", "account", "fresh", "expected"), MEASURED_SHED_CASES,
                         ids=[c[0] for c in MEASURED_SHED_CASES])
def test_load_shedding_on_the_engines_measured_kv(why: str, engine: tuple[int, int, float], account: tuple[int, int],
                                                  fresh: int, expected: str | None) -> None:
    slot = Slot(measured("a", running=engine[0], waiting=engine[1], kv=engine[2]))
    assert slot.measured
    live = Live({"a": account[0]}, {"a": account[1]}, fresh={"a": fresh})
    assert FullAt().why(slot, live) == expected


MEASURED_HOLD_CASES = [
    # (what it shows, engine (running, kv), account (requests, tokens), fresh tokens, this request's, holds?)
    ("room by the engine's report, however large the budgets in flight: no hold",
     (30, 0.43), (30, 130_000), 0, 97, False),
    ("room by the report, little sent since: no hold", (60, 0.5), (60, 250_000), 3_000, 97, False),
    ("the report's use and what was sent since leave no room: hold",
     (100, 0.9), (150, 0), 3_500, 97, True),
    ("a busy engine with KV to spare: its running sequences' completions free what they grow, no hold",
     (224, 0.76), (224, 0), 1_600, 97, False),
    ("a full cache by the report: hold", (40, 0.999), (40, 0), 0, 1_597, True),
    ("a full cache by the report, and completions since freed room: no hold", (40, 0.999), (40, 0), -2_000,
     1_597, False),
    ("nothing in flight from the gateways: never hold", (40, 0.999), (0, 0), 0, 1_597, False),
]


@pytest.mark.parametrize(("why", "engine", "account", "fresh", "tokens", "expected"), MEASURED_HOLD_CASES,
                         ids=[c[0] for c in MEASURED_HOLD_CASES])
def test_kv_hold_on_the_engines_measured_kv(why: str, engine: tuple[int, float], account: tuple[int, int],
                                           fresh: int, tokens: int, expected: bool) -> None:
    slot = Slot(measured("a", running=engine[0], kv=engine[1]))
    live = Live({"a": account[0]}, {"a": account[1]}, fresh={"a": fresh})
    assert FullAt().holds(slot, live, tokens) is expected


def test_an_unmeasured_or_unhealthy_engine_falls_back_to_the_account() -> None:
    """No KV gauge in the scrape, or an unhealthy engine's old figures: the gateway's account decides."""
    account = Live({"a": 30}, {"a": 70_000}, fresh={"a": 0})
    stale = Slot(measured("a", kv=0.1, unhealthy="hung"))
    unparsed = Slot(kvw("a", kv_tokens=33_696, kv=0.1))
    for slot in (stale, unparsed):
        assert not slot.measured
        assert FullAt().why(slot, account) == "kv"


def test_the_engines_figure_ranks_workers_not_the_budgets_sent() -> None:
    """Two engines, one holding more KV by its report but given fewer completion budgets: the
    policy weighs the engine's figures (the emptier engine wins), not the budgets."""
    fleet = (measured("a", running=20, kv=0.7), measured("b", running=20, kv=0.2))
    live = Live({"a": 20, "b": 20}, {"a": 1_000, "b": 90_000}, fresh={})
    assert decide(Routes.build(fleet), facts(None), live, POLICY).choices[0].worker.id == "b"


def test_issue_31_a_fleet_with_room_sheds_nothing() -> None:
    """Issue 31's refusals: both engines report an empty queue and KV to spare while the gateway's
    account (whole max_tokens budgets) is past twice their caches: not saturated, no hold."""
    fleet = (measured("a", running=30, kv=0.43), measured("b", running=30, kv=0.45))
    live = Live({"a": 30, "b": 30}, {"a": 140_000, "b": 140_000}, fresh={"a": 1_500, "b": 900})
    decision = decide(Routes.build(fleet), facts(None), live, POLICY, full_at=FullAt())
    assert decision.verdict == "ok"
    assert not FullAt().holds(decision.choices[0].slot, live, 97)


def test_saturated_only_when_every_eligible_worker_is_full() -> None:
    """One worker with room means no shedding; the verdict names the limit."""
    fleet = (kvw("a"), kvw("b"))
    full = Live({"a": 200, "b": 200})
    assert decide(Routes.build(fleet), facts(None), full, POLICY, full_at=FullAt()).why == "slots"
    assert decide(Routes.build(fleet), facts(None), Live({"a": 200}), POLICY, full_at=FullAt()).verdict == "ok"


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


def test_adapter_requests_say_how_they_were_placed() -> None:
    """Without an affinity key or any residency, an adapter request takes a free slot and says so."""
    fleet = (w("a", adapters=("fin",)),)
    f = RequestFacts("fin", adapter=True)
    assert decide(Routes.build(fleet), f, {}, POLICY).choices[0].reason == "adapter-free"


def test_every_candidate_is_ranked_once_for_retries() -> None:
    """The ranking lists every eligible worker exactly once, so retries can walk it."""
    fleet = tuple(w(f"w{i}", running=i) for i in range(6))
    ranked = [c.worker.id for c in decide(Routes.build(fleet), facts(), {}, POLICY, limit=6).choices]
    assert sorted(ranked) == sorted(x.id for x in fleet)


def test_options_come_from_config() -> None:
    """Routing knobs reach the policy from the gateway's config, integers too; an unknown
    knob fails loudly instead of being ignored."""
    settings = load_settings(overrides={"routing": {"balance": 1, "kv_high": 0.8}})
    policy = make_policy("fleet", settings.routing)
    assert isinstance(policy, FleetPolicy)
    assert policy.opts == FleetOptions(balance=1.0, kv_high=0.8)
    with pytest.raises(ValueError, match="slack"):
        make_policy("fleet", {"slack": 2})


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
@given(spec=loads, key=st.integers(0, 2**64 - 1), home=st.integers(0, 11), busy=st.integers(0, 300))
def test_a_key_leaves_its_home_only_when_the_account_says_it_is_saturated(
    spec: list[tuple[int, int, float, int]], key: int, home: int, busy: int
) -> None:
    """Whatever the engines' (stale) gauges say, a placed key without a second home goes
    home unless its home is at its sequence slots by the gateway's own account."""
    fleet = build(spec)
    old = fleet[home % len(fleet)]
    home_view = WorkerView(info=old.info, state="ready", load=Load(), id_hash=old.id_hash)
    fleet = tuple(home_view if x.id == old.id else x for x in fleet)
    f = RequestFacts("base", affinity_key=key, affinity_kind="prefix", home=old.id, heavy=True)
    choice = decide(Routes.build(fleet), f, Live({old.id: busy}), POLICY).choices[0]
    if choice.worker.id != old.id:
        assert busy >= Slot(home_view).capacity


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 16), key=st.integers(0, 2**64 - 1))
def test_a_worker_leaving_moves_only_its_own_keys(n: int, key: int) -> None:
    """Rendezvous hashing: removing a worker that is not a key's home leaves that key where it was."""
    ids = [f"w{i}" for i in range(n)]
    home = home_of(key, ids)
    other = next(i for i in ids if i != home)
    assert home_of(key, [i for i in ids if i != other]) == home


def aw(wid: str, running: int = 0, max_loras: int = 2, lora_slots: int = 0, active: tuple[str, ...] = ()) -> WorkerView:
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="vllm", model="base", adapters=("fin", "law", "med"),
                        capacity=100, runtime_lora=True, max_loras=max_loras),
        state="ready", load=Load(running=running, lora_slots=lora_slots, lora_active=active), id_hash=stable_hash(wid),
    )


NONE: frozenset[str] = frozenset()
ADAPTER_CASES = [
    # (what it shows, fleet, warm workers (the adapter is live there), full workers (every
    # slot live with other adapters), expected first choice, reason)
    ("a request goes where its adapter is live",
     (aw("a"), aw("b")), frozenset({"b"}), NONE, "b", "adapter-warm"),
    ("a new adapter goes to an engine with a free slot, however busier, never where every slot is taken",
     (aw("a", running=5), aw("b", running=60)), NONE, frozenset({"a"}), "b", "adapter-free"),
    ("with no free slot anywhere it waits for one on the least loaded engine, said so",
     (aw("a", running=50), aw("b", running=10)), NONE, frozenset({"a", "b"}), "b", "adapter-slot-wait"),
    ("... on the engine with the fewest adapters in demand by its report, however busier",
     (aw("a", running=10, active=("law", "med", "tax")), aw("b", running=50, active=("law", "med"))), NONE,
     frozenset({"a", "b"}), "b", "adapter-slot-wait"),
    ("a hot adapter gets an engine with a free slot once its home is lora_load_cost busier",
     (aw("a", running=80), aw("b", running=10)), frozenset({"a"}), NONE, "b", "adapter-spill"),
    ("a hot adapter stays home while the other engine is not clearly less busy",
     (aw("a", running=40), aw("b", running=20)), frozenset({"a"}), NONE, "a", "adapter-warm"),
    ("a hot adapter never spills onto an engine whose slots are all taken",
     (aw("a", running=95), aw("b", running=0)), frozenset({"a"}), frozenset({"b"}), "a", "adapter-warm"),
    ("live on an engine with more adapters than slots: a free slot elsewhere first",
     (aw("a"), aw("b", running=30)), frozenset({"a"}), frozenset({"a"}), "b", "adapter-free"),
    ("live on a crowded engine still beats waiting for a slot on another",
     (aw("a", running=30), aw("b")), frozenset({"a"}), frozenset({"a", "b"}), "a", "adapter-crowded"),
    ("engines whose adapters all fit their slots never make one wait: load decides",
     (aw("a", running=50, max_loras=3), aw("b", running=5, max_loras=3)), frozenset({"a"}), NONE, "b",
     "adapter-warm"),
    ("the engine's reported slots count, not the registered 0 of an engine attached without flags",
     (aw("a", running=50, max_loras=0, lora_slots=3), aw("b", running=5, max_loras=0, lora_slots=3)),
     frozenset({"a"}), NONE, "b", "adapter-warm"),
]


@pytest.mark.parametrize(("why", "fleet", "warm", "full", "first_id", "reason"), ADAPTER_CASES,
                         ids=[c[0] for c in ADAPTER_CASES])  # fmt: skip
def test_adapter_placement_table(why: str, fleet: tuple[WorkerView, ...], warm: frozenset[str],
                                 full: frozenset[str], first_id: str, reason: str) -> None:  # fmt: skip
    f = RequestFacts("fin", adapter=True, warm=warm, full=full, affinity_key=stable_hash("adapter\0fin"),
                     affinity_kind="adapter")
    choice = decide(Routes.build(fleet), f, {}, POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == (first_id, reason)


def test_adapter_ranking_lists_free_before_crowded_before_slot_waits() -> None:
    """Retries walk the same order: live, free slot, crowded, slot wait."""
    fleet = (aw("live"), aw("free"), aw("crowded"), aw("waits"))
    f = RequestFacts("fin", adapter=True, warm=frozenset({"live", "crowded"}),
                     full=frozenset({"crowded", "waits"}))
    ranked = [(c.worker.id, c.reason) for c in decide(Routes.build(fleet), f, {}, POLICY, limit=4).choices]
    assert ranked == [("live", "adapter-warm"), ("free", "adapter-free"), ("crowded", "adapter-crowded"),
                      ("waits", "adapter-slot-wait")]


@settings(max_examples=200, deadline=None)
@given(busy=st.lists(st.integers(0, 100), min_size=2, max_size=6), name=st.text(min_size=1, max_size=8),
       seqs=st.tuples(st.integers(0, 2**32), st.integers(0, 2**32)))
def test_replicas_place_a_new_adapter_alike(busy: list[int], name: str, seqs: tuple[int, int]) -> None:
    """Two replicas (their own request counters, hence their own jitter; workers listed in any
    order) send an adapter that is live nowhere to the same engine: the least loaded band, then
    the adapter's ring order."""
    fleet = tuple(aw(f"w{i}", running=r) for i, r in enumerate(busy))
    key = stable_hash(f"adapter\0{name}")
    one, two = (
        decide(Routes.build(order), RequestFacts("fin", adapter=True, affinity_key=key, seq=seq), {}, make_policy("fleet"))
        .choices[0].worker.id
        for order, seq in ((fleet, seqs[0]), (tuple(reversed(fleet)), seqs[1]))
    )
    assert one == two


def test_slot_reads_the_engines_reported_lora_slots() -> None:
    """Slot.max_loras is the engine's own report when it gives one, else the registered figure."""
    assert Slot(aw("a", max_loras=0, lora_slots=8)).max_loras == 8
    assert Slot(aw("a", max_loras=4)).max_loras == 4
    assert Slot(aw("a", max_loras=0)).max_loras == 0 and not Slot(aw("a", max_loras=0)).adapters_fit


@pytest.mark.parametrize(("speed", "low", "high"), [(0.5, 0.30, 0.37), (1.0, 0.45, 0.55), (0.25, 0.16, 0.24)])
def test_new_keys_split_by_speed_when_kv_weighs_in_too(speed: float, low: float, high: float) -> None:
    """A stream of one-off keys (each request a first message of its own) over two workers of one
    batch and KV cache, one at `speed`: each gets new keys in proportion to its speed (1/3 for
    half speed). Two things pulled a slow worker's share toward half, through the cache term
    of the placement (tests/e2e/test_speed_tracking.py read 0.37-0.425; this table 0.40 at half
    speed, 0.28 at a quarter): the KV a unit of work holds in flight was counted alike on
    both, though a slower card's requests hold it 1/speed as long; and each one-off key's
    prefix counted whole in its home's cache until the key was dropped, many half-lives
    after its one request, so the cache term counted keys, not work."""
    fleet = (
        WorkerView(info=WorkerInfo(id="steady", url="http://steady", engine="sim", model="base", capacity=100,
                                   kv_tokens=50_000), state="ready", load=Load(), id_hash=stable_hash("steady")),
        WorkerView(info=WorkerInfo(id="slowed", url="http://slowed", engine="sim", model="base", capacity=100,
                                   kv_tokens=50_000, speed=speed), state="ready", load=Load(),
                   id_hash=stable_hash("slowed")),
    )
    routes = Routes.build(fleet)
    homes = Homes(half_life_s=5.0)
    picked: list[str] = []
    for i in range(3000):
        now = i * 0.01  # 100 new keys a second
        worker, reason = route(fleet, homes, stable_hash(f"ticket-{i}"), now=now, prefix=20, seq=i)
        assert reason == "prefix-placed"
        picked.append(worker)
        if i % 100 == 99:  # the background pass, once a second: the KV each worker's requests hold
            # now, 4 tokens a unit of work at reference speed, for 1/speed as long on a slower card
            tokens = {s.id: int(4 * homes.placed.get(s.id, 0.0) / s.speed) for s in routes.by_model["base"].routable}
            homes.rebalance(routes.by_model, now, tokens)
    share = picked[1000:].count("slowed") / len(picked[1000:])
    assert low <= share <= high, share
