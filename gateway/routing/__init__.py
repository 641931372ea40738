"""Routing policies. Each policy is one module; `make_policy` picks one by name."""

from __future__ import annotations

from gateway.routing.base import Choice, Decision, Policy, RequestFacts, decide
from gateway.routing.least_outstanding import LeastOutstanding
from gateway.routing.round_robin import RoundRobin

POLICIES: dict[str, type[Policy]] = {
    LeastOutstanding.name: LeastOutstanding,
    RoundRobin.name: RoundRobin,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None


__all__ = ["POLICIES", "Choice", "Decision", "Policy", "RequestFacts", "decide", "make_policy"]
