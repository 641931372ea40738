"""The `fleet` policy with what the engines report they cache (their KV cache events): the
engines' figure corrects the placement where it says the prompt lives elsewhere."""

from __future__ import annotations

import pytest

from fleetgate.hashing import stable_hash
from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.routing import Live, RequestFacts, Routes, decide, make_policy

POLICY = make_policy("fleet")
KEY = stable_hash("system prompt A")


def kvw(wid: str) -> WorkerView:
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="sim", model="base", capacity=100, kv_tokens=50_000),
        state="ready", load=Load(), id_hash=stable_hash(wid),
    )


FLEET = tuple(kvw(i) for i in ("a", "b", "c"))

CASES = [
    # (what it shows, home, second, engines' cached prompt tokens, gateway's requests in flight,
    #  prompt tokens, expected (worker, reason))
    ("the home holds the prompt: it goes home, as without events",
     "a", None, {"a": 2000, "b": 2000}, {}, 2100, ("a", "prefix-hit")),
    ("the home evicted it and another engine holds it: that engine",
     "a", None, {"b": 2000}, {}, 2100, ("b", "kv-hit")),
    ("the conversation's turns are cached on another engine than its system prompt's home",
     "a", None, {"a": 1200, "c": 3000}, {"c": 40}, 3100, ("c", "kv-hit")),
    ("a few more cached blocks elsewhere are not worth leaving home",
     "a", None, {"a": 1200, "b": 1264}, {}, 3000, ("a", "prefix-hit")),
    ("the holder is saturated: the home logic decides",
     "a", None, {"b": 2000}, {"b": 100}, 2100, ("a", "prefix-hit")),
    ("of a key's two homes, the one that holds the conversation, though busier",
     "a", "b", {"a": 3000, "b": 1000}, {"a": 20, "b": 5}, 3100, ("a", "kv-hit")),
    ("...unless it is saturated: the home logic shares by load",
     "a", "b", {"a": 3000, "b": 1000}, {"a": 100}, 3100, ("b", "prefix-spill")),
    ("two homes that hold as much: shared by load, as without events",
     "a", "b", {"a": 2000, "b": 2000}, {"a": 10}, 2100, ("b", "prefix-spill")),
    ("a new key whose prompt an engine already holds (another replica, another client) is placed there",
     None, None, {"c": 2000}, {"c": 5}, 2100, ("c", "kv-placed")),
    ("two engines hold as much: the less loaded",
     "a", None, {"b": 2000, "c": 2000}, {"b": 30}, 2100, ("c", "kv-hit")),
    ("nothing held anywhere: the placement (home) decides",
     "a", None, {}, {}, 2100, ("a", "prefix-hit")),
]


@pytest.mark.parametrize(("why", "home", "second", "cached", "account", "prompt", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_cached_prefix_table(why: str, home: str | None, second: str | None, cached: dict[str, int],
                             account: dict[str, int], prompt: int, expected: tuple[str, str]) -> None:
    f = RequestFacts("base", prompt_tokens=prompt, affinity_key=KEY, affinity_kind="prefix", home=home,
                     second=second, heavy=True, cached=cached)
    choice = decide(Routes.build(FLEET), f, Live(account), POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == expected


def test_without_an_affinity_key_the_holder_is_a_hit() -> None:
    f = RequestFacts("base", prompt_tokens=500, cached={"b": 480})
    choice = decide(Routes.build(FLEET), f, Live({}), POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == ("b", "kv-hit")


def test_the_fallback_choices_follow_the_holder() -> None:
    f = RequestFacts("base", prompt_tokens=2100, affinity_key=KEY, affinity_kind="prefix", home="a",
                     cached={"b": 2000})
    decision = decide(Routes.build(FLEET), f, Live({"c": 50}), POLICY, limit=3)
    assert [(c.worker.id, c.reason) for c in decision.choices] == [
        ("b", "kv-hit"), ("a", "least-load"), ("c", "least-load")]


# The prefill queue (`Live.pending`): the prompt tokens each engine has still to prefill for the
# streams sent whose first token has not come. Three engines hold the system prompt (1,000
# tokens); the conversation (3,100 tokens) is cached on "a", its home.
SOONER = [
    # (what it shows, home, engines' cached prompt tokens, prefill queued, requests in flight, expected)
    ("a turn whose home holds it but queues 6k tokens of prefill: an engine with a short queue computes it sooner",
     "a", {"a": 3000, "b": 1000, "c": 1000}, {"a": 6000, "c": 500}, {}, ("b", "kv-sooner")),
    ("a short queue at home is not worth prefilling the conversation again elsewhere",
     "a", {"a": 3000, "b": 1000, "c": 1000}, {"a": 2000}, {}, ("a", "prefix-hit")),
    ("sooner, but by less than a quarter of the prompt's prefill: home",
     "a", {"a": 3000, "b": 1000, "c": 1000}, {"a": 2600, "b": 100, "c": 100}, {}, ("a", "prefix-hit")),
    ("a new conversation (only its system prompt cached anywhere) is placed where the least prefill waits",
     None, {"a": 1000, "b": 1000, "c": 1000}, {"a": 3000, "c": 3000}, {}, ("b", "kv-placed")),
    ("a saturated engine never takes it, however short its queue",
     "a", {"a": 3000, "b": 1000, "c": 1000}, {"a": 6000, "c": 5000}, {"b": 100}, ("a", "prefix-hit")),
    ("an engine whose holdings are unknown (no events) is not weighed",
     "a", {"a": 3000, "b": 1000}, {"a": 6000, "b": 5000}, {}, ("a", "prefix-hit")),
    ("the holder the engines' events found, if its queue is long, gives way too",
     "a", {"a": 1000, "b": 3000, "c": 1000}, {"b": 6000}, {}, ("a", "kv-sooner")),
]


@pytest.mark.parametrize(("why", "home", "cached", "pending", "account", "expected"), SOONER,
                         ids=[c[0] for c in SOONER])
def test_prefill_queue_table(why: str, home: str | None, cached: dict[str, int], pending: dict[str, int],
                             account: dict[str, int], expected: tuple[str, str]) -> None:
    f = RequestFacts("base", prompt_tokens=3100, affinity_key=KEY, affinity_kind="prefix", home=home,
                     cached=cached)
    choice = decide(Routes.build(FLEET), f, Live(account, pending=pending), POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == expected


def test_prefill_margin_zero_keeps_the_cached_home() -> None:
    f = RequestFacts("base", prompt_tokens=3100, affinity_key=KEY, affinity_kind="prefix", home="a",
                     cached={"a": 3000, "b": 1000, "c": 1000})
    live = Live({}, pending={"a": 6000, "c": 500})
    off = make_policy("fleet", {"prefill_margin": 0})
    assert (decide(Routes.build(FLEET), f, live, off).choices[0].worker.id) == "a"
    assert (decide(Routes.build(FLEET), f, live, POLICY).choices[0].worker.id) == "b"


def test_a_worker_whose_cache_would_fill_does_not_take_it() -> None:
    """A copy of the conversation on a cache already near full would evict others' prefixes (and
    tip the engine into preemption): the queue rule takes only a worker with room for it."""
    f = RequestFacts("base", prompt_tokens=3100, affinity_key=KEY, affinity_kind="prefix", home="a",
                     cached={"a": 3000, "b": 1000, "c": 1000})
    pending = {"a": 6000, "c": 500}
    # b's cache (50,000 tokens) holds 36,000 by the account: with this prompt's 2,100 it passes 75%.
    tight = Live({}, tokens={"b": 36_000}, pending=pending)
    assert (decide(Routes.build(FLEET), f, tight, POLICY).choices[0].worker.id) == "c"
    tight = Live({}, tokens={"b": 36_000, "c": 36_000}, pending=pending)
    assert (decide(Routes.build(FLEET), f, tight, POLICY).choices[0].reason) == "prefix-hit"
    roomy = Live({}, tokens={"b": 34_000}, pending=pending)
    assert (decide(Routes.build(FLEET), f, roomy, POLICY).choices[0].worker.id) == "b"


def test_the_queue_rule_never_copies_a_shared_prefix() -> None:
    """A tenant's requests share its system prompt (the key's prefix): a worker that does not hold
    it would take a copy, and the tenant would spread over the fleet's caches (the placement's
    call). A worker that holds it may take a request's own part, a conversation's turns."""
    pending = {"a": 6000}
    tenant = RequestFacts("base", prompt_tokens=1565, affinity_key=KEY, affinity_kind="prefix", home="a",
                          prefix_tokens=1500, cached={"a": 1552, "b": 0, "c": 16})
    choice = decide(Routes.build(FLEET), tenant, Live({}, pending=pending), POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == ("a", "prefix-hit")
    holder = RequestFacts("base", prompt_tokens=1565, affinity_key=KEY, affinity_kind="prefix", home="a",
                          prefix_tokens=1500, cached={"a": 1552, "b": 0, "c": 1504})
    choice = decide(Routes.build(FLEET), holder, Live({}, pending=pending), POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == ("c", "kv-sooner")
    # A conversation's turn is mostly its own: it may take its system prompt along.
    turn = RequestFacts("base", prompt_tokens=3100, affinity_key=KEY, affinity_kind="prefix", home="a",
                        prefix_tokens=1000, cached={"a": 3000, "b": 0, "c": 0})
    choice = decide(Routes.build(FLEET), turn, Live({}, pending={"a": 6000, "c": 500}), POLICY).choices[0]
    assert (choice.worker.id, choice.reason) == ("b", "kv-sooner")
