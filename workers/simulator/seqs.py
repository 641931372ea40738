"""What the scheduler works on and what it tells the world: sequences, their token events,
the engine's limits, the hooks the metrics implement, and the stats published per step."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from workers.simulator.tokens import TextSource

Status = Literal["waiting", "running", "finished", "aborted"]


@dataclass(frozen=True)
class Event:
    """One generated token's text; `finish` is set on the last one. `index` is the choice
    of the request it belongs to (the choices of one request may share a queue)."""

    text: str
    finish: str | None = None
    index: int = 0


@dataclass(eq=False, kw_only=True)
class Seq:
    """One request inside the engine."""

    id: str
    prompt_ids: list[int]
    hashes: list[int]
    source: TextSource
    target: int  # tokens to generate
    target_reason: str  # "length" at max_tokens, "stop" at a natural EOS
    adapter: str | None = None
    stop: tuple[str, ...] = ()
    # A pooling (embedding) request: prefill only; it finishes ("stop") once its prompt is
    # computed, without sampling, like vLLM's pooling runner.
    pooling: bool = False
    index: int = 0  # the choice of its request (n > 1, several prompts)
    arrival: float = 0.0
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    status: Status = "waiting"
    output_ids: list[int] = field(default_factory=list)  # the generated tokens' ids
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    registered: int = 0
    cached_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    tail: str = ""

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def generated(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self) -> list[int]:
        """Every token of the sequence, prompt and generated (vLLM's all_token_ids)."""
        return self.prompt_ids + self.output_ids


class SchedulerHooks(Protocol):
    """What the metrics see of the scheduler."""

    def on_admitted(self, seq: Seq, now: float) -> None: ...
    def on_first_token(self, seq: Seq, now: float) -> None: ...
    def on_step(self, scheduled: int, sampled: int, gaps: Mapping[float, int]) -> None:
        """A step ran: `scheduled` tokens computed, `sampled` tokens sampled; `gaps`: for
        the sequences that had sampled before, seconds since their last token -> how many
        (vLLM's inter-token latency, one observation per token)."""
        ...

    def on_finished(self, seq: Seq, reason: str, now: float) -> None: ...
    def on_preempted(self) -> None: ...
    def on_lora_loads(self, n: int, from_disk: int = 0) -> None:
        """`n` adapters entered a GPU slot this step, `from_disk` of them read from disk."""
        ...


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int
    max_loras: int
    time_scale: float
    # Adapters in GPU memory from start to end (LMDeploy's start-time adapters).
    pinned_loras: tuple[str, ...] = ()
    # Adapters held in host memory (vLLM's --max-cpu-loras; 0: as many as max_loras).
    max_cpu_loras: int = 0


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """The engine's load as vLLM's engine core publishes it: made at the end of a step,
    after that step's finished requests left and before the requests that arrived while it
    ran are queued (they join the waiting queue at the next step). /metrics shows these,
    never the live queues. `deferred`: waiting requests that the scheduler skipped
    (LoRA slots), vLLM's num_requests_waiting_by_reason{reason="deferred"}.
    `lora_adapters`: every adapter with a request in the engine, in the order they came in
    (vLLM writes this list into both labels of lora_requests_info)."""

    running: int = 0
    waiting: int = 0
    deferred: int = 0
    kv_cache_usage: float = 0.0
    lora_adapters: tuple[str, ...] = ()
