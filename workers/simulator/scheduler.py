"""A small continuous-batching scheduler shaped like vLLM V1's (read against vLLM 0.32's
`v1/core/sched/scheduler.py` and `kv_cache_manager.py`).

Each step: running sequences first (one decode token each, or the next chunk of a prefill),
then, if nothing was preempted, waiting ones, FIFO, while there is room in max_num_seqs,
the step's token budget, the KV cache and the LoRA slots. A waiting sequence is admitted
only when free blocks hold its whole uncached sequence (vLLM's default
`scheduler_reserve_full_isl`), its prefix-cached blocks shared; the first that does not fit
blocks those behind it. A waiting sequence whose adapter would make the running batch's
distinct adapters exceed max_loras is skipped and the ones behind it go first, with no
fairness (vLLM's rule): a rare adapter can wait as long as busy ones hold every slot
(loras.py keeps the slots and the host-memory cache, `max_cpu_loras`). A running sequence
takes a new block every block_size tokens; when none is free it preempts the most
recently admitted running one (recompute: its blocks freed, back to the head of the queue,
counted; its cached blocks may still hit when it is admitted again). Full blocks, prompt or generated, enter the prefix cache (kvcache.py).
The step then "runs" for a time taken from the profile (times `slowdown`, the `slow`
fault), and each sequence that caught up with its tokens samples one more, which its request handler streams at once. What the
step changed (load, admissions, preemptions) is published when it ends (`StepStats`).

The API front-end's work, where it shares the engine's cores, delays admissions and
stretches steps (frontend.py).

Everything is deterministic for a given arrival order and seed: no wall clock decides
anything except how long the loop sleeps.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from workers.simulator.frontend import Frontend
from workers.simulator.kvcache import BlockPool, extend_hashes
from workers.simulator.loras import LoraCache, LoraRequests
from workers.simulator.seqs import Event, Limits, SchedulerHooks, Seq, StepStats
from workers.timing import Profile

__all__ = ["Event", "Limits", "Scheduler", "SchedulerHooks", "Seq", "StepStats"]

# Copying an adapter from host memory into a GPU slot, as a share of reading it from disk
# (`lora_load_s`): vLLM's activation is a device copy of a few MB of weights.
HOST_COPY_SHARE = 0.1


@dataclass
class _Plan:
    work: list[tuple[Seq, int]] = field(default_factory=list)
    lora_loads: int = 0  # adapters that entered a GPU slot
    lora_disk_loads: int = 0  # of which read from disk (not in host memory)
    # Reported when the step ends, as vLLM's stats of the step are.
    admitted: list[Seq] = field(default_factory=list)
    preempted: int = 0


class Scheduler:
    def __init__(self, limits: Limits, profile: Profile, hooks: SchedulerHooks) -> None:
        self.limits = limits
        self.profile = profile
        self.hooks = hooks
        self.pool = BlockPool(limits.num_gpu_blocks)
        self.loras = self._lora_cache()
        self.lora_requests = LoraRequests()
        self.running: list[Seq] = []
        self.waiting: deque[Seq] = deque()
        self.preemptions = 0
        self.steps = 0
        self._wake = asyncio.Event()
        self.frontend = Frontend()
        # Queued since the last schedule (at the tail of `waiting`): vLLM's engine core
        # takes them from its input queue only before the next step, so its stats of the
        # running step do not count them.
        self._late: set[Seq] = set()
        self.deferred: set[Seq] = set()  # waiting, skipped for want of a LoRA slot
        self.published = StepStats()
        # Every step takes this many times its profile's time (the `slow` fault: a throttled
        # card, a neighbour on the same GPU); the engine's counters show it, the profile not.
        self.slowdown = 1.0

    def _lora_cache(self) -> LoraCache:
        lim = self.limits
        return LoraCache(lim.max_loras, lim.max_cpu_loras, lim.pinned_loras)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    # --- requests in and out -------------------------------------------------------------
    def submit(self, seq: Seq) -> None:
        self.submit_all([seq])

    def submit_all(self, seqs: Sequence[Seq]) -> None:
        """One API request's sequences (its choices, its prompts): the front-end admits them
        together, once, and vLLM's engine then runs each as a request of its own."""
        now = self._now()
        for seq in seqs:
            seq.arrival = now
        cost = self.profile.frontend_per_request_s * self.limits.time_scale
        if cost <= 0:
            for seq in seqs:
                self._enqueue(seq)
            return
        self.frontend.admit(seqs, now, cost, engine_busy=bool(self.running), then=self._enqueue)

    def _enqueue(self, seq: Seq) -> None:
        if seq.adapter:
            self.lora_requests.add(seq.adapter)
        self.waiting.append(seq)
        self._late.add(seq)
        self._wake.set()

    def abort(self, seq: Seq) -> None:
        """The client went away: drop the sequence and free what it held."""
        counted = seq.adapter is not None and seq.status in ("waiting", "running")
        if self.frontend.abort(seq):  # still in the front-end: the engine never saw it
            counted = False
        elif seq.status == "waiting":
            self.waiting.remove(seq)
            self._late.discard(seq)
            self.deferred.discard(seq)
        elif seq.status == "running":
            self.running.remove(seq)
            self.pool.release(seq.blocks)
            seq.blocks = []
        if counted and seq.adapter:
            self.lora_requests.remove(seq.adapter)
        if seq.status in ("waiting", "running"):
            seq.status = "aborted"

    def forget_adapter(self, name: str) -> None:
        self.loras.drop(name)

    def adapter_loaded(self, name: str) -> None:
        """A runtime load (/v1/load_lora_adapter): vLLM reads the weights into host memory
        at once; a reload in place takes them afresh."""
        self.loras.drop(name)
        self.loras.register(name)

    def reset(self) -> None:
        """Forget the prefix cache, the LoRA slots and the step counters; only when idle."""
        if self.running or self.waiting or self.frontend.admitting:
            raise RuntimeError("the engine is busy")
        self.pool.reset()  # keeps its event sink, which publishes AllBlocksCleared
        self.loras = self._lora_cache()
        self.preemptions = 0
        self.steps = 0
        self._publish()

    def snapshot(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_used": self.pool.num_used,
            "kv_blocks_total": self.pool.num_blocks,
            "kv_cache_usage": self.pool.usage,
            "preemptions": self.preemptions,
            "steps": self.steps,
            "loaded_loras": self.loras.resident,
            "host_loras": self.loras.in_host,
            "lora_adapters": list(self.lora_requests.names),
            "running_lora_adapters": sorted({s.adapter for s in self.running if s.adapter}),
            "waiting_lora_adapters": sorted({s.adapter for s in self.waiting if s.adapter}),
        }

    # --- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        deadline = self._now()
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                deadline = self._now()
                self.frontend.take_debt()  # done while the engine had nothing to run
            plan = self._schedule()
            if not plan.work:
                self._end_step(plan)
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.01)
                except TimeoutError:
                    pass
                deadline = self._now()
                continue
            deadline += (self._step_seconds(plan) + self.frontend.take_debt()) * self.slowdown
            now = self._now()
            if deadline < now:  # we fell behind: do not try to catch up in a burst
                deadline = now
            await asyncio.sleep(deadline - now)
            self._complete(plan, self._now())

    def _step_seconds(self, plan: _Plan) -> float:
        p = self.profile
        decoding = sum(1 for seq, n in plan.work if n == 1 and seq.generated)
        prefill = sum(n for seq, n in plan.work if not (n == 1 and seq.generated))
        step = p.base_step_s + p.decode_per_seq_s * decoding + p.prefill_per_token_s * prefill
        if any(seq.adapter for seq, _ in plan.work):
            step = p.lora_step(step)
        copies = plan.lora_loads - plan.lora_disk_loads
        loading = p.lora_load_s * (plan.lora_disk_loads + HOST_COPY_SHARE * copies)
        return (step + loading) * self.limits.time_scale

    def _blocks_needed(self, seq: Seq, n: int, held: int) -> int:
        return max(0, math.ceil((seq.num_computed + n) / self.limits.block_size) - held)

    def _schedule(self) -> _Plan:
        plan = _Plan()
        budget = self.limits.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self._blocks_needed(seq, n, len(seq.blocks))
            while need > self.pool.num_free and self.running[-1] is not seq:
                self._preempt(self.running[-1], plan)
            if need > self.pool.num_free:
                if len(self.running) == 1:  # alone and still too big: the cache is full
                    self._finish(seq, "length", self._now())
                else:
                    self._preempt(seq, plan)
                break
            seq.blocks += self.pool.allocate(need)
            self._cache_blocks(seq, seq.num_computed + n)
            plan.work.append((seq, n))
            budget -= n
            i += 1
        if not plan.preempted:  # vLLM admits nothing in a step that preempted
            budget = self._admit(plan, budget)
        self._late.clear()
        if plan.lora_loads:
            self.hooks.on_lora_loads(plan.lora_loads, plan.lora_disk_loads)
        return plan

    def _admit(self, plan: _Plan, budget: int) -> int:
        bs = self.limits.block_size
        busy = {s.adapter for s in self.running if s.adapter}
        skipped: list[Seq] = []
        while self.waiting and len(self.running) < self.limits.max_num_seqs and budget > 0:
            seq = self.waiting.popleft()
            if seq.adapter:
                got = self.loras.acquire(seq.adapter, busy)
                if got is None:  # every slot serves a running adapter: let others pass
                    skipped.append(seq)
                    self.deferred.add(seq)
                    continue
                if got != "resident":
                    plan.lora_loads += 1
                    plan.lora_disk_loads += got == "disk"
            # Full blocks only, and never the whole sequence: its last token is computed.
            hit = self.pool.lookup(seq.hashes, (seq.num_tokens - 1) // bs)
            seq.num_computed = len(hit) * bs
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self._blocks_needed(seq, n, len(hit))
            # Blocks for the whole sequence, not only this step's chunk, must be free. A
            # sequence longer than the whole cache (vLLM would refuse to start) is let in
            # chunk by chunk.
            whole = self._blocks_needed(seq, seq.num_tokens - seq.num_computed, len(hit))
            if whole <= self.pool.num_blocks:
                need = max(need, whole)
            if need > self.pool.num_free - self.pool.evictable_among(hit):
                seq.num_computed = 0
                self.waiting.appendleft(seq)
                break
            self.deferred.discard(seq)
            self.pool.touch(hit)
            seq.blocks = hit + self.pool.allocate(self._blocks_needed(seq, n, len(hit)))
            seq.registered = len(hit)
            self._cache_blocks(seq, seq.num_computed + n)
            seq.status = "running"
            if seq.admitted_at is None:  # a preempted sequence's queries are not counted
                seq.admitted_at = self._now()
                seq.cached_tokens = seq.num_computed
                plan.admitted.append(seq)
            if seq.adapter:
                busy.add(seq.adapter)
            self.running.append(seq)
            plan.work.append((seq, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _cache_blocks(self, seq: Seq, num_tokens: int) -> None:
        """Enter the full blocks among the first `num_tokens` into the prefix cache when
        they are scheduled, as vLLM V1 does (not once computed): a sequence admitted later
        in the same step, such as the next choice of an n > 1 request, hits them. Blocks
        that generated tokens filled are hashed on along the prompt's chain, as vLLM does."""
        full, bs = num_tokens // self.limits.block_size, self.limits.block_size
        if full > seq.registered:
            ids = seq.token_ids()
            extend_hashes(seq.hashes, ids[: full * bs], bs, seq.adapter or "")
            self.pool.cache_full_blocks(seq.blocks, seq.hashes, seq.registered, full, ids, bs,
                                        seq.adapter)  # fmt: skip
            seq.registered = full

    def _preempt(self, seq: Seq, plan: _Plan) -> None:
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks, seq.num_computed, seq.registered = [], 0, 0
        seq.status = "waiting"
        self.waiting.appendleft(seq)
        self.preemptions += 1
        plan.preempted += 1

    def _complete(self, plan: _Plan, now: float) -> None:
        self.steps += 1
        sampled = outputs = scheduled = 0
        gaps: dict[float, int] = {}
        for seq, n in plan.work:
            if seq.status != "running":
                continue
            scheduled += n
            seq.num_computed += n
            if seq.num_computed == seq.num_tokens:
                outputs += 1
                if seq.pooling:
                    self._pooled(seq, now)
                else:
                    sampled += 1
                    if seq.last_token_at is not None:
                        gap = now - seq.last_token_at
                        gaps[gap] = gaps.get(gap, 0) + 1
                    seq.last_token_at = now
                    self._sample(seq, now)
        # Detokenizing and streaming these tokens (or writing out a pooled vector) runs
        # during the next step, on its CPU.
        self.frontend.charge(outputs * self.profile.frontend_per_token_s * self.limits.time_scale)
        self.hooks.on_step(scheduled, sampled, gaps)
        self._end_step(plan)

    def _end_step(self, plan: _Plan) -> None:
        """Publish the step's stats: its admissions (prefix cache queries and hits, queue
        times), its preemptions, and the load as it stands after the step."""
        for seq in plan.admitted:
            assert seq.admitted_at is not None
            self.hooks.on_admitted(seq, seq.admitted_at)
        for _ in range(plan.preempted):
            self.hooks.on_preempted()
        self._publish()

    def _publish(self) -> None:
        queued = len(self.waiting) - len(self._late)  # the late ones are the tail
        self.published = StepStats(
            running=len(self.running),
            waiting=queued,
            deferred=len(self.deferred),
            kv_cache_usage=self.pool.usage,
            lora_adapters=self.lora_requests.names,
        )

    def _pooled(self, seq: Seq, now: float) -> None:
        # vLLM counts the pooled output as the first "token" (TTFT, prompt tokens) and the
        # request as finished with reason "stop"; no generation tokens.
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.hooks.on_first_token(seq, now)
        self._finish(seq, "stop", now)

    def _sample(self, seq: Seq, now: float) -> None:
        token_id, piece = seq.source.token()
        seq.output_ids.append(token_id)
        finish = seq.target_reason if seq.generated >= seq.target else None
        if seq.stop:
            text = seq.tail + piece
            cut = min((text.find(s) for s in seq.stop if s in text), default=-1)
            if cut >= 0:
                piece, finish = piece[: max(0, cut - len(seq.tail))], "stop"
            seq.tail = text[-max(len(s) for s in seq.stop) :]
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.hooks.on_first_token(seq, now)
        seq.events.put_nowait(Event(piece, finish, seq.index))
        if finish:
            self._finish(seq, finish, now, emitted=True)

    def _finish(self, seq: Seq, reason: str, now: float, emitted: bool = False) -> None:
        if not emitted:
            seq.events.put_nowait(Event("", reason, seq.index))
        self.running.remove(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.status = "finished"
        if seq.adapter:
            self.lora_requests.remove(seq.adapter)
        self.hooks.on_finished(seq, reason, now)
