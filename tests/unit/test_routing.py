"""The routing decision as pure code: filters and policies over hand-built snapshots."""

from __future__ import annotations

import pytest

from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.routing import RequestFacts, Routes, decide, make_policy


def w(
    wid: str, *, model: str = "base", adapters: tuple[str, ...] = (), state: str = "ready",
    drain: bool = False, waiting: int = 0, max_len: int = 4096, capacity: int = 256, pooling: bool = False,
) -> WorkerView:
    return WorkerView(
        info=WorkerInfo(id=wid, url=f"http://{wid}", engine="sim", model=model, adapters=adapters,
                        max_model_len=max_len, capacity=capacity, pooling=pooling),
        state=state,  # type: ignore[arg-type]
        load=Load(waiting=waiting),
        admin_drain=drain,
    )


FLEET = (
    w("a", adapters=("fin",)),
    w("b", waiting=2),
    w("c", model="other"),
    w("d", drain=True),
    w("e", state="draining"),
    w("f", state="starting"),
    w("long", max_len=32768, waiting=5),
    w("emb", model="embedder", pooling=True),
)

CASES = [
    # (what it shows, facts, inflight, exclude, verdict, ranked ids)
    ("least outstanding first; drained, draining and starting workers are skipped",
     RequestFacts("base"), {}, (), "ok", ["a", "b", "long"]),
    ("gateway in-flight counts as outstanding", RequestFacts("base"), {"a": 3}, (), "ok", ["b", "a", "long"]),
    ("only workers holding the adapter serve it", RequestFacts("fin"), {}, (), "ok", ["a"]),
    ("a model nobody serves is unknown", RequestFacts("nope"), {}, (), "unknown_model", []),
    ("a model served only by drained workers has no worker", RequestFacts("fin"), {}, ("a",), "no_worker", []),
    ("excluded (already tried) workers are skipped", RequestFacts("base"), {}, ("a",), "ok", ["b", "long"]),
    ("a long prompt goes only where it fits", RequestFacts("base", prompt_tokens=9000, max_tokens=100),
     {}, (), "ok", ["long"]),
    ("a prompt that fits nowhere is a context-length verdict",
     RequestFacts("base", prompt_tokens=40000), {}, (), "context_length", []),
    ("a model served only by starting workers is unknown to clients", RequestFacts("other"), {}, ("c",),
     "no_worker", []),
    ("a pinned request goes to its worker however busy", RequestFacts("base", pinned="long"), {}, (), "ok",
     ["long"]),
    ("a pinned request follows its worker into a drain (the state it continues lives there)",
     RequestFacts("base", pinned="e"), {}, (), "ok", ["e"]),
    ("a pinned request's worker once tried leaves no other", RequestFacts("base", pinned="b"), {}, ("b",),
     "no_worker", []),
    ("embeddings go to embedding models", RequestFacts("embedder", pooling=True), {}, (), "ok", ["emb"]),
    ("text generation is not asked of an embedding model", RequestFacts("embedder", pooling=False), {}, (),
     "wrong_task", []),
    ("nor embeddings of a generative one", RequestFacts("base", pooling=True), {}, (), "wrong_task", []),
    ("either will do for tokenizing", RequestFacts("embedder"), {}, (), "ok", ["emb"]),
    ("a pinned worker that does not serve the model is no worker", RequestFacts("base", pinned="c"), {}, (),
     "no_worker", []),
]


@pytest.mark.parametrize(("why", "facts", "inflight", "exclude", "verdict", "ids"), CASES, ids=[c[0] for c in CASES])
def test_least_outstanding_decisions(why: str, facts: RequestFacts, inflight: dict[str, int],
                                     exclude: tuple[str, ...], verdict: str, ids: list[str]) -> None:
    decision = decide(Routes.build(FLEET), facts, inflight, make_policy("least_outstanding"), exclude)
    assert decision.verdict == verdict
    assert [c.worker.id for c in decision.choices] == ids


def test_a_pinned_decision_says_so() -> None:
    decision = decide(Routes.build(FLEET), RequestFacts("base", pinned="b"), {}, make_policy("fleet"))
    assert [(c.worker.id, c.reason) for c in decision.choices] == [("b", "response-pinned")]


def test_context_length_verdict_names_the_largest_limit() -> None:
    """The 400 message can tell the client the largest context any worker offers."""
    decision = decide(Routes.build(FLEET), RequestFacts("base", prompt_tokens=40000), {}, make_policy("least_outstanding"))
    assert decision.limit == 32768


def test_ties_break_by_capacity_then_id_the_same_on_every_replica() -> None:
    """Equal load prefers the larger engine, then the id: deterministic across gateways."""
    fleet = (w("z", capacity=64), w("y", capacity=256), w("x", capacity=256))
    ranked = decide(Routes.build(fleet), RequestFacts("base"), {"z": 1, "y": 1, "x": 1}, make_policy("least_outstanding"))
    assert [c.worker.id for c in ranked.choices] == ["x", "y", "z"]


def test_round_robin_rotates_with_the_request_counter() -> None:
    """Round-robin walks the eligible workers in id order, one step per request."""
    fleet = (w("a"), w("b"), w("c"), w("d", drain=True))
    policy = make_policy("round_robin")
    firsts = [decide(Routes.build(fleet), RequestFacts("base", seq=i), {}, policy).choices[0].worker.id for i in range(4)]
    assert firsts == ["a", "b", "c", "a"]


def test_unknown_policy_is_refused() -> None:
    """A typo in the policy name fails loudly at start-up."""
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("fastest")
