"""Routing policies. Each policy is one module; `make_policy` picks one by name."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.routing.base import Choice, Decision, FullAt, Live, Policy, RequestFacts, decide
from gateway.routing.fleet import FleetOptions, FleetPolicy
from gateway.routing.least_outstanding import LeastOutstanding
from gateway.routing.random_pick import RandomPick
from gateway.routing.round_robin import RoundRobin
from gateway.routing.table import Routes

POLICIES: dict[str, type[Any]] = {
    FleetPolicy.name: FleetPolicy,
    LeastOutstanding.name: LeastOutstanding,
    RoundRobin.name: RoundRobin,
    RandomPick.name: RandomPick,
}


def make_policy(name: str, options: dict[str, Any] | None = None) -> Policy:
    """The policy called `name`; `options` tune the `fleet` policy (see FleetOptions)."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}")
    if name == FleetPolicy.name:
        try:
            return FleetPolicy(msgspec.convert(options or {}, FleetOptions))
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad `routing` setting for the fleet policy: {exc}") from None
    return POLICIES[name]()  # type: ignore[no-any-return]


__all__ = [
    "POLICIES", "Choice", "Decision", "FleetOptions", "FullAt", "Live", "Policy", "RequestFacts", "Routes", "decide",
    "make_policy",
]
