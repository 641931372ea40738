"""LoRA adapters inside one engine, as vLLM keeps them (read against vLLM's
`lora/worker_manager.py` LRUCacheWorkerLoRAManager and `v1/metrics/stats.py`).

Two least-recently-used caches: `max_loras` GPU slots, the adapters a batch can use, and
`max_cpu_loras` adapters held in host memory (vLLM's default: as many as the slots). An
adapter in a slot costs nothing; one in host memory is copied into a slot (cheap); one in
neither is read from disk first (`lora_load_s`). A slot is taken from the least recently
used adapter that no running request uses; when every slot serves a running request the
adapter cannot be scheduled (the scheduler skips its requests: vLLM's max_loras rule).
An adapter leaving host memory leaves its slot too. `pinned` adapters (LMDeploy's
start-time ones) are loaded for good and take no slot from the others.

`LoraRequests` is vLLM's per-adapter request count behind `vllm:lora_requests_info`: an
adapter enters when its first request reaches the engine and leaves when its last one
finishes; vLLM writes the names in that order into both the `running_lora_adapters` and
the `waiting_lora_adapters` label (seen on vLLM 0.32: the two are always equal).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import Literal

# What taking a slot for an adapter cost: nothing, a copy from host memory, a disk load.
Fetch = Literal["resident", "cpu", "disk"]


class LoraCache:
    def __init__(self, max_loras: int, max_cpu_loras: int = 0, pinned: tuple[str, ...] = ()) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.pinned = frozenset(pinned)
        self._gpu: OrderedDict[str, None] = OrderedDict()
        self._cpu: OrderedDict[str, None] = OrderedDict()

    @property
    def resident(self) -> list[str]:
        """Adapters in GPU memory: the pinned ones, then the slots, least recently used first."""
        return sorted(self.pinned) + list(self._gpu)

    @property
    def in_host(self) -> list[str]:
        """Adapters in host memory, least recently used first."""
        return list(self._cpu)

    def acquire(self, name: str, busy: Collection[str]) -> Fetch | None:
        """Put `name` in a GPU slot for the next step; None when every slot serves one of
        `busy` (the adapters of running requests)."""
        if name in self.pinned:
            return "resident"
        if name in self._gpu:
            self._gpu.move_to_end(name)
            self._cpu.move_to_end(name)
            return "resident"
        if len(self._gpu) >= self.max_loras:
            victim = next((a for a in self._gpu if a not in busy), None)
            if victim is None:
                return None
            del self._gpu[victim]  # it stays in host memory
        fetch: Fetch = "cpu" if name in self._cpu else "disk"
        self.register(name)
        self._gpu[name] = None
        return fetch

    def register(self, name: str) -> None:
        """Hold `name` in host memory (a runtime load does this at once), evicting the least
        recently used adapter that is not in a slot when host memory is full."""
        if name in self.pinned:
            return
        if name in self._cpu:
            self._cpu.move_to_end(name)
            return
        if len(self._cpu) >= self.max_cpu_loras:
            victim = next((a for a in self._cpu if a not in self._gpu), None)
            if victim is None:  # host memory holds exactly the slots: the oldest slot goes
                victim = next(iter(self._cpu))
                self._gpu.pop(victim, None)
            del self._cpu[victim]
        self._cpu[name] = None

    def drop(self, name: str) -> None:
        """Forget `name` (unloaded, or reloaded in place: its next use reads it again)."""
        self._gpu.pop(name, None)
        self._cpu.pop(name, None)


class LoraRequests:
    """Requests per adapter inside the engine, in the order the adapters came in."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}

    def add(self, name: str) -> None:
        self._count[name] = self._count.get(name, 0) + 1

    def remove(self, name: str) -> None:
        left = self._count.get(name, 0) - 1
        if left > 0:
            self._count[name] = left
        else:
            self._count.pop(name, None)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._count)
