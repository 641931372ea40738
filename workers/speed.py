"""A card's speed for routing (WorkerInfo.speed), and where it came from.

Speed is how fast a sequence runs relative to the reference: an H100 with a 7B model, the
`h100-7b` timing profile (a T4 is ~0.25). The gateway weighs a worker's batch by
capacity x speed. The start-up figure comes from one of three sources, never from a
silent default:

    "profile"   the card's timing profile: a card nvidia-smi names and the profiles know,
                or a simulator's own profile (its time_scale divides the speed)
    "declared"  `--speed X` on the agent's command line
    "measured"  a probe batch timed at start (`workers/warmup.py`), against what the
                reference profile predicts for the same batch

The start-up figure only seeds the running measurement: while the engine serves, the
agent times its steps from the engine's own counters against `reference_step`
(`workers/speedometer.py`) and publishes that with the load.

Everything here is pure; the agent and the simulator engine (`workers/engines/sim.py`)
both take the profile choice from this module. The profiles themselves are the cards'
timing profiles (`workers/timing.py`), which the simulator runs by as well.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from workers.timing import PROFILES, profile_for_gpu, relative_speed

if TYPE_CHECKING:
    from workers.engines.base import EngineSpec

REFERENCE = "h100-7b"
# The fallback profile_for_gpu answers for a card it does not know.
_FALLBACK = "l40s-7b"
# A measurement outside this range says more about the probe (a stub, a broken clock)
# than about the card: it is clamped, and the log says so.
MEASURED_RANGE = (0.02, 50.0)


def _named(name: str) -> str | None:
    """A profile named outright ("t4-7b", or a card "t4" with the 7B shape)."""
    if name in PROFILES:
        return name
    if f"{name}-7b" in PROFILES:
        return f"{name}-7b"
    return None


def _matched(gpu_name: str) -> str | None:
    """The profile of a card nvidia-smi names, or None when no profile's card is in the name
    (profile_for_gpu then answers its fallback, which is not this card's)."""
    found = profile_for_gpu(gpu_name)
    if found != _FALLBACK:
        return found
    compact = gpu_name.lower().replace(" ", "").replace("-", "")
    return found if _FALLBACK.removesuffix("-7b") in compact else None


def known_profile(spec: EngineSpec) -> str | None:
    """The timing profile that describes this engine's card, or None when nothing says which."""
    for candidate in (spec.options.get("profile"), spec.gpu.profile if spec.gpu else None):
        if candidate:
            return _named(str(candidate)) or _matched(str(candidate))
    return _matched(spec.gpu.name) if spec.gpu else None


def sim_profile(spec: EngineSpec) -> str:
    """The simulator's timing profile: the one `known_profile` finds, else the L40S's."""
    return known_profile(spec) or _FALLBACK


def card_speed(spec: EngineSpec) -> float:
    """The speed from the card's timing profile (`sim_profile`'s choice); a simulator's
    `time_scale` (simulated seconds per real second) divides it."""
    speed = relative_speed(PROFILES[sim_profile(spec)], REFERENCE)
    scale = float(spec.options.get("time_scale") or 1.0)
    return round(speed / scale, 3) if scale > 0 else speed


def reference_seconds(prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> float:
    """How long the reference card takes for these requests run as one batch: every prompt
    token prefilled, then one decode step per output token of the longest request, each
    step costing its launch overhead plus its share per running sequence.

    For 16 requests of 1000 + 100 tokens this is 16 x the cost `relative_speed` compares,
    so a measured speed and a profile speed mean the same thing."""
    p = PROFILES[REFERENCE]
    steps = max(output_tokens, default=0)
    return (sum(prompt_tokens) * p.prefill_per_token_s + steps * p.base_step_s
            + sum(output_tokens) * p.decode_per_seq_s)


def measured_speed(seconds: float, prompt_tokens: Sequence[int], output_tokens: Sequence[int]) -> float:
    """Reference time over the measured time, clamped to MEASURED_RANGE."""
    low, high = MEASURED_RANGE
    if seconds <= 0:
        return high
    return round(min(high, max(low, reference_seconds(prompt_tokens, output_tokens) / seconds)), 3)


def reference_step(decoding: float, prefill: float) -> float:
    """How long one engine step takes on the reference card with `decoding` sequences each
    sampling a token and `prefill` prompt tokens computed beside them: the same cost model
    as `reference_seconds`, one step at a time, so a speed measured from an engine's step
    times means what a probe's does."""
    p = PROFILES[REFERENCE]
    return p.base_step_s + decoding * p.decode_per_seq_s + prefill * p.prefill_per_token_s


def clamp_speed(value: float) -> float:
    low, high = MEASURED_RANGE
    return min(high, max(low, value))
