"""The fleet arranged for routing: built once per snapshot, read by every request.

Everything that does not change between two snapshots is computed here, in the
background refresh, so the per-request decision is a few attribute reads per
worker: who serves which model, each worker's capacity and engine-reported load,
and a consistent-hash ring per model for affinity.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fleetgate.hashing import mix, stable_hash
from fleetgate.schema import WorkerView

# Points on a model's ring for its largest worker (smaller ones get fewer, at least
# MIN_VNODES): enough to spread keys evenly over a few workers.
VNODES = 40
MIN_VNODES = 4
# The KV tokens a request sent since its engine's last report is predicted to take of its
# completion budget before the next report (a second or so of decoding), beside its prompt.
# The running ones' growth is not added: in steady state their completions free as much, and
# the report shows the level (adding it held every request on a busy engine with KV to spare).
REPORT_GROWTH_TOKENS = 32


class Slot:
    """One worker, as routing reads it (plain attributes: no property calls on the hot path)."""

    __slots__ = (
        "adapters_fit", "capacity", "engine_busy", "id", "id_hash", "kv", "kv_held", "kv_tokens", "lora_active",
        "lora_ts", "max_len", "max_loras", "measured", "pooling", "routable", "running", "speed", "spin", "view",
        "waiting", "weight",
    )

    def __init__(self, view: WorkerView) -> None:
        load = view.load
        self.view = view
        self.id = view.info.id
        self.id_hash = view.id_hash or stable_hash(self.id)
        # 16 fixed bits per worker for the policy's cheap per-request jitter.
        self.spin = (self.id_hash >> 24) & 0xFFFF
        # Sequences the engine runs at once (its batch size), and its KV cache in tokens (0:
        # unknown). Both are what the engine declared, never inferred from a second-old
        # gauge: running / KV use collapses when the cache thrashes and marked idle engines full.
        capacity = max(view.info.capacity, 1)
        self.capacity = capacity
        self.kv_tokens = view.info.kv_tokens
        # What the worker can carry, in reference-card sequences: its batch times its speed,
        # as its agent measures it while the engine serves (published with the load), else
        # the start-up figure it registered.
        self.speed = load.speed if load.speed > 0 else view.info.speed if view.info.speed > 0 else 1.0
        self.weight = capacity * self.speed
        self.max_len = view.info.max_model_len
        self.pooling = view.info.pooling
        self.routable = view.routable
        self.engine_busy = load.running + load.waiting
        self.running = load.running
        self.waiting = load.waiting
        self.kv = load.kv_cache_usage
        # The engine measured its KV use in its last report (and the cache size is known): then
        # what it holds is its figure, and the gateway's account only adds what was sent since
        # (`Live.fresh`). An unhealthy engine's figures are an old scrape's: not the truth now.
        self.measured = bool(load.kv_measured and self.kv_tokens and not load.unhealthy)
        self.kv_held = load.kv_cache_usage * self.kv_tokens if self.measured else 0.0
        # The adapters with requests in the engine by its last report (running or waiting), and
        # when it made it: the gateway's own sends since predict until the next one.
        self.lora_active = frozenset(load.lora_active)
        self.lora_ts = load.ts
        # Its LoRA slots as the engine reports them (else as registered; 0: unknown): at most
        # this many distinct adapters run in one batch, the others' requests wait.
        self.max_loras = load.lora_slots or view.info.max_loras
        # All its adapters fit in its slots at once: none ever waits for a slot.
        self.adapters_fit = 0 < len(view.info.adapters) <= self.max_loras


@dataclass(frozen=True, slots=True)
class ModelRoutes:
    """The workers that serve one model name (base or adapter), and its affinity ring."""

    slots: tuple[Slot, ...]
    ring_points: tuple[int, ...]
    ring_owner: tuple[int, ...]
    # The routable ones, and the smallest max_model_len among them: a prompt that fits that
    # fits them all, so the common request filters nothing.
    routable: tuple[Slot, ...] = ()
    min_len: int = 0
    # True when every routable one is an embedding model, False when none is, None if mixed.
    pooling: bool | None = None

    @classmethod
    def build(cls, slots: Sequence[Slot]) -> ModelRoutes:
        ordered = tuple(sorted(slots, key=lambda s: s.id))
        # A worker's share of the keys follows its size (its configured batch times its
        # registered start-up speed, not the measured one, which moves every second: the
        # keys must not): a small or slow card is home to fewer.
        size = {s.id: max(s.view.info.capacity, 1) * (s.view.info.speed or 1.0) for s in ordered}
        largest = max(size.values(), default=1.0)
        points: list[tuple[int, int]] = []
        for index, slot in enumerate(ordered):
            vnodes = max(MIN_VNODES, round(VNODES * size[slot.id] / largest))
            points.extend((mix(slot.id_hash, v), index) for v in range(vnodes))
        points.sort()
        routable = tuple(s for s in ordered if s.routable)
        kinds = {s.pooling for s in routable}
        return cls(ordered, tuple(p for p, _ in points), tuple(i for _, i in points), routable,
                   min((s.max_len for s in routable), default=0), kinds.pop() if len(kinds) == 1 else None)

    def ring_order(self, key: int) -> Iterator[Slot]:
        """Workers in the key's ring order, each once: the same on every gateway replica."""
        points = self.ring_points
        if not points:
            return
        n = len(points)
        start = bisect.bisect_left(points, key)
        seen: set[int] = set()
        owners = self.ring_owner
        for step in range(n):
            owner = owners[(start + step) % n]
            if owner not in seen:
                seen.add(owner)
                yield self.slots[owner]
                if len(seen) == len(self.slots):
                    return


@dataclass(frozen=True, slots=True)
class Routes:
    by_model: dict[str, ModelRoutes]

    @classmethod
    def build(cls, workers: Sequence[WorkerView]) -> Routes:
        serving: dict[str, list[Slot]] = {}
        for view in workers:
            if view.state == "starting":
                continue
            slot = Slot(view)
            serving.setdefault(view.info.model, []).append(slot)
            for adapter in view.info.adapters:
                serving.setdefault(adapter, []).append(slot)
        return cls({model: ModelRoutes.build(slots) for model, slots in serving.items()})
