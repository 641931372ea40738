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
    ("nothing known anywhere: the placement (home) decides",
     "a", None, {}, {}, 2100, ("a", "prefix-hit")),
    ("every engine indexed and none holds any of it, loads even: home",
     "a", None, {"a": 0, "b": 0, "c": 0}, {}, 2100, ("a", "prefix-hit")),
    ("every engine holds the system prompt, none the conversation, the home busy: the least loaded",
     "a", None, {"a": 1000, "b": 1000, "c": 1000}, {"a": 40, "b": 20}, 3500, ("c", "kv-spread")),
    ("...the home only a little busier (within spill_margin): home",
     "a", None, {"a": 1000, "b": 1000, "c": 1000}, {"a": 42, "b": 40, "c": 40}, 3500, ("a", "prefix-hit")),
    ("the home alone holds the tenant's prompt: home, however busy (the home logic decides)",
     "a", None, {"a": 1500, "b": 0, "c": 0}, {"a": 60}, 1565, ("a", "prefix-hit")),
    ("the home holds the conversation, the others only its system prompt: home, though busier",
     "a", None, {"a": 3300, "b": 1000, "c": 1000}, {"a": 60}, 3500, ("a", "prefix-hit")),
    ("a less loaded worker whose holdings are unknown (no events): the home logic decides",
     "a", None, {"a": 1000, "b": 1000}, {"a": 40, "b": 20}, 3500, ("a", "prefix-hit")),
    ("a saturated peer is no peer",
     "a", None, {"a": 1000, "b": 1000, "c": 1000}, {"a": 40, "b": 100, "c": 60}, 3500, ("a", "prefix-hit")),
    ("an engine without the system prompt is no peer of a home that has it",
     "a", None, {"a": 1000, "b": 0, "c": 0}, {"a": 40}, 3500, ("a", "prefix-hit")),
    ("a key with two homes: the home logic shares it by load",
     "a", "b", {"a": 1000, "b": 1000, "c": 1000}, {"a": 40, "b": 30}, 3500, ("b", "prefix-spill")),
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
