"""Policies are built by name from the `routing` settings, each by its own class."""

from __future__ import annotations

import pytest

from gateway.routing import POLICIES, FleetPolicy, make_policy


def test_every_policy_is_registered_under_its_own_name() -> None:
    """POLICIES maps each class's `name` to it, and make_policy builds that class."""
    assert sorted(POLICIES) == ["fleet", "least_outstanding", "random", "round_robin"]
    for name, cls in POLICIES.items():
        policy = make_policy(name)
        assert type(policy) is cls and policy.name == name


def test_the_fleet_policy_takes_the_routing_knobs_and_refuses_unknown_ones() -> None:
    """`routing` knobs reach FleetOptions; an unknown knob stops the gateway at start."""
    policy = make_policy("fleet", {"balance": 0.4, "kv_high": 0.8})
    assert isinstance(policy, FleetPolicy)
    assert (policy.opts.balance, policy.opts.kv_high) == (0.4, 0.8)
    with pytest.raises(ValueError, match="bad `routing` setting for the fleet policy"):
        make_policy("fleet", {"no_such_knob": 1})


def test_the_baselines_ignore_the_fleet_knobs_and_an_unknown_name_is_refused() -> None:
    """round_robin with the fleet's knobs configured still starts; a typo in the name does not."""
    assert make_policy("round_robin", {"balance": 0.4}).name == "round_robin"
    with pytest.raises(ValueError, match="unknown routing policy 'fleeet'"):
        make_policy("fleeet")
