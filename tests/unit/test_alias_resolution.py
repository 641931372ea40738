"""The pure alias and fallback resolution (gateway/models/aliases.py), table-driven."""

from __future__ import annotations

import msgspec
import pytest

from gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoWorkerAvailable,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.models.aliases import (
    AliasTarget,
    Route,
    fallback_reason,
    listed,
    pick,
    problems,
    resolve,
    with_model,
)

ALIASES = {
    "chat": (AliasTarget(model="base", weight=90), AliasTarget(model="canary", weight=10)),
    "solo": (AliasTarget(model="only"),),
}
FALLBACKS = {"base": ("big",), "canary": ("base",), "chat": ("spare",), "x": ("solo", "y")}


@pytest.mark.parametrize(
    ("model", "key", "expected"),
    [
        ("plain", "k", Route(("plain",))),  # not an alias, no fallbacks: itself only
        ("x", "k", Route(("x", "only", "y"))),  # a fallback that is an alias resolves to its model
        ("solo", "k", Route(("only",), alias="solo")),
        ("base", "k", Route(("base", "big"))),
    ],
)
def test_resolve_table(model: str, key: str, expected: Route) -> None:
    """Each request names the models it tries, in order: chosen, its fallbacks, the alias's."""
    assert resolve(ALIASES, FALLBACKS, model, key) == expected


def test_an_alias_follows_its_chosen_models_fallbacks_then_its_own() -> None:
    """A request for `chat` tries its chosen model, that model's list, then `chat`'s list."""
    routes = {resolve(ALIASES, FALLBACKS, "chat", f"k{i}").models for i in range(200)}
    assert routes == {("base", "big", "spare"), ("canary", "base", "spare")}


def test_weights_split_keys_and_a_key_keeps_its_choice() -> None:
    """90/10 over 10,000 keys lands within a binomial 6-sigma bound, and one key always gets
    the same model (every replica agrees)."""
    n = 10_000
    canary = sum(pick(ALIASES["chat"], f"req-{i}", "chat") == "canary" for i in range(n))
    assert abs(canary - 1000) < 6 * (n * 0.1 * 0.9) ** 0.5
    assert len({pick(ALIASES["chat"], "session-7", "chat") for _ in range(50)}) == 1


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (Overloaded("full"), "no_capacity"),
        (NoWorkerAvailable("none"), "no_capacity"),
        (UpstreamError("503"), "no_capacity"),
        (ModelNotFound("gone"), "no_model"),
        (ContextLengthExceeded("long"), "context_length"),
        (UpstreamTimeout("slow"), None),  # the engine may have done the work: no second run
        (InvalidRequest("bad"), None),
        (GatewayError("bug"), None),
    ],
)
def test_fallback_reason_table(error: GatewayError, reason: str | None) -> None:
    """Only a lack of capacity, of the model, or of context sends a request on."""
    assert fallback_reason(error) == reason


@pytest.mark.parametrize(
    ("aliases", "fallbacks", "wanted"),
    [
        ({"a": ()}, {}, "names no model"),
        ({"a": (AliasTarget(model="m", weight=0),)}, {}, "must be above 0"),
        ({"a": (AliasTarget(model="b"),), "b": (AliasTarget(model="m"),)}, {}, "another alias"),
        ({}, {"m": ("m",)}, "names itself"),
        ({}, {"m": ()}, "is empty"),
    ],
)
def test_problems_table(aliases: dict, fallbacks: dict, wanted: str) -> None:  # type: ignore[type-arg]
    """Each mistake in the settings is named in one line."""
    found = problems(aliases, fallbacks)
    assert len(found) == 1 and wanted in found[0]


def test_no_problems_in_good_settings() -> None:
    assert problems(ALIASES, FALLBACKS) == []


def test_with_model_and_listed() -> None:
    """The body gets the real model; /v1/models gains the aliases it does not already list."""
    body = with_model(b'{"model":"chat","messages":[{"role":"user","content":"hi"}]}', "base")
    assert msgspec.json.decode(body) == {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
    models = msgspec.json.decode(listed(ALIASES, b'{"object":"list","data":[{"id":"solo"}]}'))
    assert [m["id"] for m in models["data"]] == ["solo", "chat"]
    assert models["data"][1]["fleetgate_alias_of"] == ["base", "canary"]
