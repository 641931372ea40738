"""The agent's LoRA slot count: what it publishes with each load and registers for the gateways."""

from __future__ import annotations

import pytest

from fleetgate.schema import Load, WorkerInfo
from workers.agent import Agent
from workers.engines import get_engine
from workers.engines.base import EngineSpec
from workers.options import AgentOptions


def agent(engine: str, managed: bool, runtime_lora: bool, max_loras: int, adapters: tuple[str, ...]) -> Agent:
    opts = AgentOptions(worker_id="w", engine=engine, managed=managed, url="http://engine",
                        spec=EngineSpec(model="m", served_name="m", port=1))
    a = Agent(opts, get_engine(engine))
    a.info = WorkerInfo(id="w", url="http://engine", engine=engine, model="m", adapters=adapters,
                        runtime_lora=runtime_lora, max_loras=max_loras)
    return a


@pytest.mark.parametrize(
    ("why", "engine", "runtime_lora", "max_loras", "adapters", "reported", "slots"),
    [
        ("the engine's own report wins, even over a registered figure", "vllm", True, 4, ("a",), 8, 8),
        ("an external vLLM (registered 0) takes the engine's report", "vllm", True, 0, ("a",), 8, 8),
        ("no report: the figure it was started with", "vllm", True, 4, ("a",), 0, 4),
        ("no report, adapters fixed at start: one slot each (all resident)", "lmdeploy", False, 0, ("a", "b"), 0, 2),
        ("no report, runtime loading, nothing registered: unknown", "vllm", True, 0, ("a",), 0, 0),
    ],
)
def test_published_slots(why: str, engine: str, runtime_lora: bool, max_loras: int, adapters: tuple[str, ...],
                         reported: int, slots: int) -> None:
    a = agent(engine, managed=False, runtime_lora=runtime_lora, max_loras=max_loras, adapters=adapters)
    assert a._with_slots(Load(lora_slots=reported)).lora_slots == slots


async def test_reported_slots_are_registered_before_ready() -> None:
    """An engine attached without flags registers 0 slots while starting; the first report fills
    them in before the worker turns ready (no registry write while starting: the ready
    registration carries them)."""
    a = agent("vllm", managed=False, runtime_lora=True, max_loras=0, adapters=("a",))
    a.load = a._with_slots(Load(lora_slots=8))
    await a._learn_slots()
    assert a.info is not None and a.info.max_loras == 8
