"""Routing policies. Each policy is one module whose class has a `name` and builds itself from
the `routing` settings (`from_options`); `make_policy` picks one by name."""

from __future__ import annotations

from typing import Any

from gateway.routing.base import Choice, Decision, FullAt, Live, Policy, RequestFacts, decide
from gateway.routing.fleet import FleetOptions, FleetPolicy
from gateway.routing.least_outstanding import LeastOutstanding
from gateway.routing.random_pick import RandomPick
from gateway.routing.round_robin import RoundRobin
from gateway.routing.table import Routes

POLICIES: dict[str, type[Any]] = {cls.name: cls for cls in (FleetPolicy, LeastOutstanding, RoundRobin, RandomPick)}


def make_policy(name: str, options: dict[str, Any] | None = None) -> Policy:
    """The policy called `name`, built from `options` (the `routing` settings)."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    return POLICIES[name].from_options(options or {})  # type: ignore[no-any-return]


__all__ = [
    "POLICIES", "Choice", "Decision", "FleetOptions", "FullAt", "Live", "Policy", "RequestFacts", "Routes", "decide",
    "make_policy",
]
