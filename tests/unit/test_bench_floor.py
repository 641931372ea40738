"""The adapter-load floor: exact on small cases, and never above what a real routing does."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetgate_tools.bench.floor import Host, adapter_load_floor, belady_loads


@pytest.mark.parametrize(
    ("trace", "slots", "loads"),
    [
        ([], 2, 0),
        (["a", "a", "a"], 1, 1),
        (["a", "b", "a", "b"], 1, 4),
        (["a", "b", "a", "b"], 2, 2),
        # c evicts a (needed later than b); a evicts b (never needed again): 4 (LRU: 5)
        (["a", "b", "c", "b", "a", "c"], 2, 4),
        (["a", "b", "c", "a", "b", "c"], 2, 4),
        (["a", "b", "c"], 0, 3),
    ],
)
def test_belady(trace: list[str], slots: int, loads: int) -> None:
    assert belady_loads(trace, slots) == loads


def H(wid: str, adapters: str, slots: int, pinned: bool = False) -> Host:
    return Host(wid, frozenset(adapters), slots, pinned)


@pytest.mark.parametrize(
    ("trace", "hosts", "floor"),
    [
        # one worker: Belady on its slots
        ("abab", [H("w", "ab", 1)], 4),
        # a worker that loads its adapters at start serves them for free
        ("ababc", [H("lmd", "ab", 0, pinned=True), H("v", "abc", 1)], 1),
        # two one-slot workers, each the only home of one adapter: one load each
        ("abab", [H("x", "a", 1), H("y", "b", 1)], 2),
        # a subset decides: only y serves a and b, in one slot (4 loads), x has c (1 more)
        ("ababc", [H("x", "c", 1), H("y", "ab", 1)], 5),
        # every adapter everywhere: the pooled slots bound it
        ("abcabc", [H("x", "abc", 1), H("y", "abc", 1)], 4),
    ],
)
def test_floor_cases(trace: str, hosts: list[Host], floor: int) -> None:
    assert adapter_load_floor(list(trace), hosts) == floor


def _lru_routing_loads(trace: list[str], hosts: list[Host], rng: random.Random) -> int:
    """Loads of a random routing among the workers that serve each adapter, each LRU."""
    caches = {h.id: collections.OrderedDict[str, None]() for h in hosts}
    loads = 0
    for a in trace:
        able = [h for h in hosts if a in h.adapters]
        h = rng.choice(able)
        if h.pinned:
            continue
        cache = caches[h.id]
        if a in cache:
            cache.move_to_end(a)
            continue
        loads += 1
        if len(cache) >= h.slots:
            cache.popitem(last=False)
        cache[a] = None
    return loads


@settings(max_examples=150, deadline=None)
@given(
    trace=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=40),
    layout=st.lists(
        st.tuples(st.sets(st.sampled_from("abcdef"), min_size=1), st.integers(1, 3), st.booleans()),
        min_size=1, max_size=4,
    ),
    seed=st.integers(0, 1000),
)
def test_floor_never_above_a_real_routing(trace: list[str], layout: list, seed: int) -> None:  # type: ignore[type-arg]
    hosts = [Host(f"w{i}", frozenset(a), s, p) for i, (a, s, p) in enumerate(layout)]
    served = set().union(*(h.adapters for h in hosts))
    trace = [a for a in trace if a in served]
    floor = adapter_load_floor(trace, hosts)
    free = set().union(*(h.adapters for h in hosts if h.pinned)) if any(h.pinned for h in hosts) else set()
    assert floor >= len({a for a in trace if a not in free})
    rng = random.Random(seed)
    for _ in range(5):
        assert floor <= _lru_routing_loads(trace, hosts, rng)
