"""One simulated engine's state: its settings, flavour, scheduler, adapters and faults.

The HTTP handlers in `workers/simulator/server.py` read and drive it.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from fleetgate.hashing import stable_hash
from workers.simulator.config import SimConfig
from workers.simulator.flavors import SimError, make_flavor
from workers.simulator.kv_events import KvEventsConfig, SimKvPublisher
from workers.simulator.kvcache import block_hashes
from workers.simulator.pooling import Embeddings
from workers.simulator.requests import Context, Prepared, Prompt
from workers.simulator.responses import Responses
from workers.simulator.scheduler import Scheduler
from workers.simulator.seqs import Event, Limits, Seq
from workers.simulator.tokens import MEAN_OUTPUT_TOKENS, TextSource, load_tokens


class Simulator:
    """One engine: its settings, flavour, scheduler, adapters and faults."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.flavor = make_flavor(config)
        self.metrics = self.flavor.make_metrics(config)
        # vLLM loads an adapter's weights into a slot on first use (and swaps them, LRU);
        # LMDeploy loads every adapter it is started with at start-up, for good.
        pinned = () if self.flavor.runtime_lora else tuple(config.lora_modules)
        self.block_size = config.resolved("block_size")
        limits = Limits(
            max_num_seqs=config.resolved("max_num_seqs"),
            max_num_batched_tokens=config.resolved("max_num_batched_tokens"),
            num_gpu_blocks=config.resolved("num_gpu_blocks"),
            block_size=self.block_size,
            max_loras=config.lora_slots,
            time_scale=config.time_scale,
            pinned_loras=pinned,
            max_cpu_loras=config.max_cpu_loras or 0,
        )
        self.scheduler = Scheduler(limits, config.timing, self.metrics)
        self.scheduler.slowdown = config.faults.slow
        self.kv_events: SimKvPublisher | None = None
        if config.kv_events_config is not None:
            kv_config = KvEventsConfig.from_json(config.kv_events_config)
            if kv_config.publishes:
                self.kv_events = SimKvPublisher(kv_config)
                self.scheduler.pool.events = self.kv_events
        self.adapters: dict[str, str] = dict(config.lora_modules)
        self.faults = config.faults
        self.context = Context(
            served_name=config.served_model_name,
            adapters=self.adapters,
            tokens=load_tokens(config.model_path),
            max_model_len=config.max_model_len,
            kv_tokens=limits.num_gpu_blocks * self.block_size,
            flavor=self.flavor,
        )
        self.responses = Responses(store_enabled=config.responses_store, block_size=self.block_size)
        self.embeddings = Embeddings(config.model_path, self.block_size)
        self.accepted = 0
        self._fault_rng = random.Random(config.seed ^ 0x5EED)
        self._die_timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self.created = int(time.time())

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        if self.kv_events is not None:
            self.kv_events.start()
        self._task = asyncio.create_task(self.scheduler.run(), name="sim-scheduler")
        self.arm_die_timer()
        try:
            yield
        finally:
            await self.stop()

    async def stop(self, app: web.Application | None = None) -> None:
        """Stop stepping; open streams stall, like vLLM's on SIGTERM."""
        if self._task:
            self._task.cancel()
        if self._die_timer:
            self._die_timer.cancel()
        await self.responses.aclose()
        await self.stop_kv_events()

    async def stop_kv_events(self) -> None:
        """Close the KV cache events publisher for good; the engine serves on without it."""
        publisher, self.kv_events = self.kv_events, None
        if publisher is not None:
            self.scheduler.pool.events = None
            await publisher.aclose()

    def arm_die_timer(self) -> None:
        if self._die_timer:
            self._die_timer.cancel()
            self._die_timer = None
        if self.faults.die_at is not None:
            loop = asyncio.get_running_loop()
            self._die_timer = loop.call_later(self.faults.die_at, os._exit, 1)

    def admit_or_fail(self) -> None:
        """Apply the request-level faults before a request is taken."""
        if self.faults.die_after is not None and self.accepted >= self.faults.die_after:
            os._exit(1)
        self.accepted += 1
        if self.faults.error_rate and self._fault_rng.random() < self.faults.error_rate:
            self.metrics.on_failed()
            raise SimError(500, "internal", "Simulated engine failure (fault error_rate).")

    def new_seq(
        self, prep: Prepared, prompt: Prompt | None = None, index: int = 0,
        events: asyncio.Queue[Event] | None = None,
    ) -> Seq:  # fmt: skip
        """The engine sequence of choice `index` of `prompt` (the first prompt by default)."""
        prompt = prompt or prep.prompts[0]
        namespace = prep.adapter or ""
        seed = self.config.seed + prep.seed + stable_hash(namespace, prompt.text) + index
        source = TextSource(seed, self.context.tokens)
        eos = source.eos_after(MEAN_OUTPUT_TOKENS)
        natural_stop = not prep.ignore_eos and eos < prompt.max_tokens
        if prep.tool_call is not None:  # structured output: it stops where the JSON ends
            eos, natural_stop = len(prep.tool_call.pieces), len(prep.tool_call.pieces) <= prompt.max_tokens
        return Seq(
            id=f"seq-{self.accepted}" + (f"-{index}" if index else ""),
            prompt_ids=prompt.ids,
            hashes=block_hashes(prompt.ids, self.block_size, namespace),
            source=source,
            target=eos if natural_stop else prompt.max_tokens,
            target_reason="stop" if natural_stop else "length",
            adapter=prep.adapter,
            stop=prep.stop,
            index=index,
            events=events if events is not None else asyncio.Queue(),
        )

    def new_seqs(self, prep: Prepared) -> list[Seq]:
        """One sequence per choice, prompt-major like vLLM's indexes, on one event queue."""
        events: asyncio.Queue[Event] = asyncio.Queue()
        return [
            self.new_seq(prep, prompt, p * prep.n + c, events)
            for p, prompt in enumerate(prep.prompts)
            for c in range(prep.n)
        ]

    def model_card(self, name: str, root: str, parent: str | None) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": self.flavor.owned_by,
            "root": root,
            "parent": parent,
            "max_model_len": self.config.max_model_len if parent is None else None,
            "permission": [
                {
                    "id": f"modelperm-{name}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
