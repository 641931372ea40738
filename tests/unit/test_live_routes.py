"""The effective routes: the YAML's, less the names deleted live, overlaid by the live records."""

from __future__ import annotations

import msgspec

from fleetgate.keys import Keys
from gateway.models.aliases import AliasTarget, pick, problems
from gateway.models.live_routes import AliasSpec, FallbackSpec, LiveRoutes, Routes

YAML_ALIASES = {"chat": (AliasTarget(model="a"),), "old": (AliasTarget(model="b"),)}
YAML_FALLBACKS = {"a": ("b",)}


def _live() -> LiveRoutes:
    return LiveRoutes(None, Keys("t"), YAML_ALIASES, YAML_FALLBACKS)  # type: ignore[arg-type]  # build only


def test_before_any_read_the_yaml_routes() -> None:
    assert _live().current == Routes(YAML_ALIASES, YAML_FALLBACKS)


def test_live_records_win_by_name_and_a_deletion_hides_a_yaml_name() -> None:
    live = _live()
    routes = live.build(
        {b"chat": msgspec.json.encode(AliasSpec(targets=(AliasTarget(model="c", weight=2),))),
         b"new": msgspec.json.encode(AliasSpec(targets=(AliasTarget(model="d"),)))},
        {b"x": msgspec.json.encode(FallbackSpec(models=("a",)))},
        {b"alias:old": b"1", b"fallback:a": b"1"},
    )
    assert routes.aliases == {"chat": (AliasTarget(model="c", weight=2),), "new": (AliasTarget(model="d"),)}
    assert routes.fallbacks == {"x": ("a",)}
    assert routes.source("alias", "chat") == "api" and live.current is routes


def test_an_unreadable_record_is_skipped_not_fatal() -> None:
    routes = _live().build({b"bad": b"{not json", b"worse": b'{"targets": 3}'}, {}, {})
    assert routes.aliases == YAML_ALIASES


def test_a_change_is_checked_against_the_whole() -> None:
    """An alias named like another alias's target would chain aliases: a new problem."""
    routes = Routes(YAML_ALIASES, YAML_FALLBACKS)
    assert routes.problems() == []
    assert routes.changed("alias", "a", (AliasTarget(model="z"),)).problems() == [
        "alias `chat` names another alias `a`; name models or adapters only"]
    assert routes.changed("alias", "chat", None).aliases == {"old": YAML_ALIASES["old"]}


def test_a_zero_weight_target_gets_no_traffic_but_is_allowed() -> None:
    targets = (AliasTarget(model="on", weight=100), AliasTarget(model="off", weight=0))
    assert problems({"c": targets}, {}) == []
    assert {pick(targets, f"k{i}", "c") for i in range(500)} == {"on"}
