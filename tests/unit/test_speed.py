"""workers/speed.py: which profile describes a card, and how a measured speed is computed.

The measured speed must mean what a profile speed means (relative_speed's workload timed
on the reference card), so a probe of a simulated card must come out near its profile's
speed: that is checked against a real simulator in tests/e2e/test_agent.py.
"""

from __future__ import annotations

import pytest

from fleetgate.schema import GpuInfo
from workers.engines import EngineSpec
from workers.speed import (
    MEASURED_RANGE,
    REFERENCE,
    card_speed,
    known_profile,
    measured_speed,
    reference_seconds,
)
from workers.timing import PROFILES, relative_speed


def _spec(gpu: str = "", **options: object) -> EngineSpec:
    return EngineSpec(model="m", served_name="m", port=1, gpu=GpuInfo(name=gpu) if gpu else None,
                      options=dict(options))


@pytest.mark.parametrize(
    ("spec", "profile"),
    [
        (_spec("NVIDIA H100 80GB HBM3"), "h100-7b"),
        (_spec("NVIDIA H200"), "h200-7b"),
        (_spec("NVIDIA L40S"), "l40s-7b"),
        (_spec("Tesla T4"), "t4-7b"),
        (_spec(profile="t4-7b"), "t4-7b"),
        (_spec(profile="a100-80g"), "a100-80g-7b"),
        (_spec("NVIDIA B200"), None),  # a card the profiles do not model
        (_spec("Radeon Instinct MI300X"), None),
        (_spec(), None),  # an external engine: nothing says which card
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_known_profile_only_for_cards_the_profiles_model(spec: EngineSpec, profile: str | None) -> None:
    """A card nvidia-smi names and the profiles know gets its profile; any other gets none
    (not the L40S's, which is what the simulator falls back to)."""
    assert known_profile(spec) == profile


def test_card_speed_is_the_profiles_relative_speed_scaled_by_time() -> None:
    """A profile's speed, divided by a simulator's time_scale."""
    assert card_speed(_spec("Tesla T4")) == relative_speed(PROFILES["t4-7b"])
    assert card_speed(_spec(profile="h100-7b", time_scale=0.5)) == 2.0


def test_reference_time_of_relative_speeds_workload_is_sixteen_of_its_costs() -> None:
    """16 requests of 1000 + 100 tokens on the reference card take 16 x relative_speed's cost,
    so timing that batch on a card measures the same ratio a profile states."""
    p = PROFILES[REFERENCE]
    cost = 1000 * p.prefill_per_token_s + 100 * (p.base_step_s / 16 + p.decode_per_seq_s)
    assert reference_seconds([1000] * 16, [100] * 16) == pytest.approx(16 * cost)
    t4 = PROFILES["t4-7b"]
    t4_cost = 1000 * t4.prefill_per_token_s + 100 * (t4.base_step_s / 16 + t4.decode_per_seq_s)
    assert measured_speed(16 * t4_cost, [1000] * 16, [100] * 16) == relative_speed(t4)


def test_measured_speed_is_clamped() -> None:
    """An instant answer (a stub) or a stuck clock gives the range's ends, not infinity."""
    assert measured_speed(0.0, [10], [10]) == MEASURED_RANGE[1]
    assert measured_speed(1e-9, [10], [10]) == MEASURED_RANGE[1]
    assert measured_speed(1e6, [10], [10]) == MEASURED_RANGE[0]
