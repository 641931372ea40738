"""An adapter request's system prompt in the gateway's KV account (gateway/request/requests.py
`shared_prefix`, gateway/accounts/inflight.py): requests of one adapter and one system prompt
share its KV blocks on an engine, so the account counts that prefix once per worker, not once
per request (issue 36: counted per request, 16 requests sent between two reports of an
engine filled its 33,696-token cache on paper and held every later request `hold_max_s`)."""

from __future__ import annotations

import json

import pytest

from gateway.accounts.inflight import SharedInflight
from gateway.request.requests import affinity, parse_request, prompt_tokens, shared_prefix

SYSTEM = "s" * 6000  # ~1,500 tokens


def _probe(adapter: str, system: str | None, question: str = "q" * 260):  # type: ignore[no-untyped-def]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return parse_request(json.dumps({"model": adapter, "messages": messages}).encode(), "chat")


def _prefix(adapter: str, system: str | None) -> tuple[int, int | None]:
    probe = _probe(adapter, system)
    _, kind = affinity(probe, None, True)
    assert kind == "adapter"
    return shared_prefix(probe, kind, prompt_tokens(probe, "chat", None, None)[0])


@pytest.mark.parametrize(
    ("what", "a", "b", "same_key"),
    [
        ("one adapter, one system prompt: one prefix", ("a0", SYSTEM), ("a0", SYSTEM), True),
        ("two adapters, one system prompt: two (the LoRA id is part of the engine's block hash)",
         ("a0", SYSTEM), ("a1", SYSTEM), False),
        ("one adapter, two tenants' system prompts: two", ("a0", SYSTEM), ("a0", "t" * 6000), False),
    ],
)
def test_adapter_requests_share_a_prefix_by_adapter_and_system_prompt(
    what: str, a: tuple[str, str], b: tuple[str, str], same_key: bool,
) -> None:
    (tokens_a, key_a), (tokens_b, key_b) = _prefix(*a), _prefix(*b)
    assert tokens_a == tokens_b == 1500, what
    assert (key_a == key_b) is same_key, what
    # Meeting on a worker stays by adapter alone.
    assert affinity(_probe(*a), None, True)[0] == affinity(_probe(a[0], b[1]), None, True)[0], what


def test_no_system_prompt_no_shared_prefix() -> None:
    assert _prefix("a0", None) == (0, None)


def test_a_base_model_request_shares_its_system_prompt_under_its_affinity_key() -> None:
    probe = parse_request(json.dumps({"model": "base", "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]}).encode(), "chat")
    _, kind = affinity(probe, None)
    assert shared_prefix(probe, kind, prompt_tokens(probe, "chat", None, None)[0]) == (1500, None)


def test_the_account_counts_an_adapters_prompt_once_per_worker() -> None:
    """What 16 requests of one adapter and prompt add to a worker's KV account before its
    engine's next report: their own question and first tokens each, the prompt once."""
    inflight = SharedInflight(None, "g1")  # type: ignore[arg-type]  # no sync runs here: no Redis
    prefix, key = _prefix("a0", SYSTEM)
    probe = _probe("a0", SYSTEM)
    own = prompt_tokens(probe, "chat", None, None)[0] - prefix
    fresh = own + 32
    for _ in range(16):
        inflight.add("w0", own + 64, key, prefix, fresh)
    assert inflight.total_fresh["w0"] == prefix + 16 * fresh
    assert inflight.total_fresh["w0"] < 4_000  # was 16 x ~1,600 = ~26,000 of a 33,696-token cache
    for _ in range(16):
        inflight.done("w0", own + 64, key, prefix, fresh)
    assert "w0" not in inflight.total_fresh
