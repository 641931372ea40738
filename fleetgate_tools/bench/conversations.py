"""Multi-turn conversations (issue 31's "A workload that needs it"): Poisson arrivals of
conversations, several turns each, think time between turns, and each turn carrying the
whole conversation so far with the engine's own answers in it.

A conversation is planned in full from the seed before a run (`plan_conversations`): when it
starts, which of a few shared system prompts it opens with, its own context (a pasted
document, ~`context_tokens`, in the first user message), every question, the think time
before each turn and the answer length. What is not planned is the answers: a turn is sent
only when the previous one has finished, with the answer *as the engine streamed it*
appended (`run_conversations`). Real answers rather than synthetic ones, because an engine
that caches the blocks it generated (vLLM does) then finds the whole previous turn in its
prefix cache; a synthetic answer would never match and would understate what keeping a
conversation on its engine is worth. Every strategy gets the identical plan; only the
answers' text differs (random-weight engines and the simulator produce random text of the
planned length: `ignore_eos`, so the same work everywhere).

No session header and no `user` field are sent, as an ordinary OpenAI client sends none: only
what a router knows of prefixes can keep a conversation on the engine that holds it.

A turn that fails ends its conversation (its later turns are never sent). The run waits for
the conversations until `drain_s` after the planned end of the last one (its start plus its
think times), then cuts what is still in flight (TTFT censored at the cut, as in
loadgen.run_requests); turns not yet sent by then count as unsent. A slow strategy therefore
sends fewer turns: the report gives turns sent against planned.

Token counts are sized for the byte estimate (workloads.BYTES_PER_TOKEN); a real tokenizer
(the tiny model's, the GPU model's) counts differently, and the report prints the engines'.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec

from fleetgate_tools.bench.arrivals import poisson_arrivals
from fleetgate_tools.bench.engines import WorkerRef
from fleetgate_tools.bench.loadgen import POOL, Outcome, send_one, targets
from fleetgate_tools.bench.report import percentile
from fleetgate_tools.bench.workloads import BenchRequest, Draft, FleetFacts, words, zipf_weights

# Request ids: conversation id x TURN_IDS + turn index.
TURN_IDS = 1000


class Turn(msgspec.Struct, kw_only=True, frozen=True):
    question: str
    think_s: float = 0.0  # the pause after the previous answer (0 for the first turn)
    max_tokens: int = 128


class Conversation(msgspec.Struct, kw_only=True, frozen=True):
    id: int
    at: float  # seconds after the run starts
    model: str
    system: str
    context: str  # the conversation's own content, opening its first user message
    turns: list[Turn]

    @property
    def tag(self) -> str:
        return f"conv-{self.id}"

    def span_s(self) -> float:
        """Its planned length, think times only (answers take more)."""
        return sum(t.think_s for t in self.turns)

    def first_user(self) -> str:
        return f"{self.context}\n\n{self.turns[0].question}" if self.context else self.turns[0].question

    def request(self, k: int, history: list[dict[str, str]], at: float) -> BenchRequest:
        """Turn k after `history` (the system prompt, earlier questions and answers)."""
        question = self.first_user() if k == 0 else self.turns[k].question
        return BenchRequest(id=self.id * TURN_IDS + k, at=at, model=self.model,
                            messages=[*history, {"role": "user", "content": question}],
                            max_tokens=self.turns[k].max_tokens, tag=self.tag)  # fmt: skip


def multiturn(rng: random.Random, fleet: FleetFacts, p: Mapping[str, Any]) -> Iterator[Conversation]:
    """Endless conversations without arrival times (at = 0), in order.

    Parameters (defaults): system_prompts (4) shared prompts of system_tokens (600), each
    conversation picks one uniformly (or prompt i with weight 1/(i+1)^system_zipf when that is
    above 0: a few popular apps); context_tokens (1500) of its own; turns_min..turns_max
    (3..8) turns, uniform; questions of user_tokens (80); answers of max_tokens (128);
    think time exponential with mean think_s (4.0), at least think_min_s (0.5).
    """
    n_prompts = int(p.get("system_prompts", 4))
    sys_tokens = int(p.get("system_tokens", 600))
    ctx_tokens = int(p.get("context_tokens", 1500))
    lo, hi = int(p.get("turns_min", 3)), int(p.get("turns_max", 8))
    user_tokens = int(p.get("user_tokens", 80))
    max_tokens = int(p.get("max_tokens", 128))
    think, think_min = float(p.get("think_s", 4.0)), float(p.get("think_min_s", 0.5))
    if n_prompts < 1 or not 1 <= lo <= hi or think < 0 or max_tokens < 1:
        raise ValueError("multiturn needs system_prompts >= 1, 1 <= turns_min <= turns_max, think_s >= 0")
    prompts = [f"[system prompt {i}] " + words(random.Random(rng.random()), sys_tokens) for i in range(n_prompts)]
    weights = zipf_weights(n_prompts, float(p.get("system_zipf", 0.0)))
    for cid in itertools.count():
        n = rng.randint(lo, hi)
        # The numbers make each conversation's text its own (no hit beyond the system prompt
        # by chance).
        context = f"[document {cid}] " + words(rng, ctx_tokens) if ctx_tokens > 0 else ""
        turns = [Turn(question=f"question {cid}.{k}: " + words(rng, user_tokens),
                      think_s=0.0 if k == 0 else round(max(think_min, rng.expovariate(1 / think)) if think else 0.0, 3),
                      max_tokens=max_tokens) for k in range(n)]  # fmt: skip
        yield Conversation(id=cid, at=0.0, model=fleet.model, system=rng.choices(prompts, weights)[0],
                           context=context, turns=turns)  # fmt: skip


ConversationGen = Callable[[random.Random, FleetFacts, Mapping[str, Any]], Iterator[Conversation]]
CONVERSATION_WORKLOADS: dict[str, ConversationGen] = {"multiturn": multiturn}


def conversations(name: str, seed: int, fleet: FleetFacts, params: Mapping[str, Any] | None = None) -> Iterator[Conversation]:
    try:
        gen = CONVERSATION_WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown conversation workload {name!r}; known: {', '.join(CONVERSATION_WORKLOADS)}") from None
    return gen(random.Random(f"{name}:{seed}"), fleet, dict(params or {}))


def plan_conversations(gen: Iterator[Conversation], rate: float, duration: float, seed: int) -> list[Conversation]:
    """Conversations starting as a Poisson process at `rate` a second for `duration` s."""
    times = poisson_arrivals(rate, duration, seed)
    return [msgspec.structs.replace(c, at=round(at, 6)) for c, at in zip(gen, times, strict=False)]


def sample_turns(convs: Sequence[Conversation], answer: Callable[[int], str]) -> list[Draft]:
    """Every turn of `convs` as a request draft, with synthetic answers (`answer(tokens)`):
    what the cache-blind capacity estimate (fleet.capacity) is computed from."""
    out = []
    for c in convs:
        history = [{"role": "system", "content": c.system}]
        for k, turn in enumerate(c.turns):
            req = c.request(k, history, 0.0)
            out.append(Draft(model=c.model, messages=req.messages, max_tokens=turn.max_tokens))
            history = [*req.messages, {"role": "assistant", "content": answer(turn.max_tokens)}]
    return out


# ---------------------------------------------------------------- the driver


class TurnLog(msgspec.Struct, kw_only=True):
    """What a run did with the plan: turns planned, sent, and each outcome's turn."""

    planned: int = 0
    sent: int = 0
    turn_of: dict[int, int] = msgspec.field(default_factory=dict)  # request id -> turn index
    completed: int = 0  # conversations whose every turn succeeded


async def run_conversations(
    target: str | Callable[[BenchRequest], WorkerRef],
    convs: Sequence[Conversation],
    *,
    pool: int = POOL,
    drain_s: float = 10.0,
    api_key: str | None = None,
    on_progress: Callable[[int, int, int], None] | None = None,
) -> tuple[list[Outcome], float, TurnLog]:
    """Play every conversation (see the module's docstring); the outcomes of the turns sent,
    in conversation then turn order, the run's wall time and what was sent."""
    where = targets(target)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    log = TurnLog(planned=sum(len(c.turns) for c in convs))
    outcomes: dict[int, list[Outcome]] = {c.id: [] for c in convs}
    in_flight: dict[int, tuple[Outcome, float]] = {}
    done = 0
    end_of_plan = max((c.at + c.span_s() for c in convs), default=0.0)
    connector = aiohttp.TCPConnector(limit=pool, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        begin = time.perf_counter()
        deadline = begin + end_of_plan + drain_s

        async def converse(c: Conversation) -> None:
            nonlocal done
            await asyncio.sleep(max(0.0, begin + c.at - time.perf_counter()))
            history = [{"role": "system", "content": c.system}]
            for k, turn in enumerate(c.turns):
                if k:
                    await asyncio.sleep(turn.think_s)
                t0 = time.perf_counter()
                if t0 >= deadline:
                    return
                req = c.request(k, history, round(t0 - begin, 6))
                out = Outcome(id=req.id, tag=req.tag, at=req.at, pool_full=len(in_flight) >= pool)
                outcomes[c.id].append(out)
                log.sent += 1
                log.turn_of[req.id] = k
                url, worker = where(req)
                answer: list[str] = []
                in_flight[req.id] = (out, t0)
                try:
                    await send_one(session, url, req, t0, headers, out, worker, answer=answer)
                finally:
                    in_flight.pop(req.id, None)
                    done += 1
                if out.error:
                    return
                history = [*req.messages, {"role": "assistant", "content": "".join(answer)}]
            log.completed += 1

        tasks = [asyncio.create_task(converse(c)) for c in convs]
        while not all(t.done() for t in tasks) and time.perf_counter() < deadline:
            await asyncio.sleep(0.1)
            if on_progress:
                on_progress(log.sent, done, log.planned)
        cut = time.perf_counter()
        for out, t0 in list(in_flight.values()):
            out.error, out.message = "timeout", "cut at the drain deadline"
            if out.ttft is None:  # censored: at least this long
                out.ttft = cut - t0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if on_progress:
            on_progress(log.sent, done, log.planned)
    return [o for c in convs for o in outcomes[c.id]], cut - begin, log


# ---------------------------------------------------------------- figures


def live_context(by_conv: Mapping[str, Sequence[Outcome]], until_s: float, step_s: float = 0.5) -> list[int]:
    """Tokens of context the live conversations hold, every `step_s` from 0 to `until_s`: a
    conversation holds its last answered turn's prompt + answer (the engines' counts) from
    that turn's start until its next turn starts, or until its last turn's answer ends."""
    spans: list[tuple[float, float, int]] = []
    for turns in by_conv.values():
        for k, o in enumerate(turns):
            if o.error or not o.prompt_tokens or o.e2e is None:
                continue
            end = turns[k + 1].at if k + 1 < len(turns) else o.at + o.e2e
            spans.append((o.at, end, o.prompt_tokens + o.out_tokens))
    return [sum(n for a, b, n in spans if a <= t < b) for t in (i * step_s for i in range(int(until_s / step_s) + 1))]


def conversation_stats(outcomes: Sequence[Outcome], log: TurnLog, n_convs: int, window_s: float | None = None,
                       kv_tokens: int = 0) -> dict[str, Any]:  # fmt: skip
    """A run's conversation figures: turns planned and sent, conversations completed, TTFT of
    first turns and of later ones (censored timeouts included, as in report.summarise), the
    share of later turns served by another worker than the turn before (`moved`), the
    engines' mean prompt of later turns, and the context the live conversations held while
    conversations were planned (t <= window_s; `live_tokens_*`) against the fleet's KV cache
    (`kv_tokens`, summed over the engines; `live_over_kv`: the mean over it)."""
    turn = lambda o: log.turn_of.get(o.id, 0)  # noqa: E731
    timed = [o for o in outcomes if o.ttft is not None and (not o.error or o.error == "timeout")]
    first = [o.ttft for o in timed if turn(o) == 0 and o.ttft is not None]
    later = [o.ttft for o in timed if turn(o) > 0 and o.ttft is not None]
    by_conv: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_conv.setdefault(o.tag, []).append(o)
    moves = follows = 0
    for turns in by_conv.values():
        for prev, cur in itertools.pairwise(turns):
            if prev.worker and cur.worker:
                follows += 1
                moves += prev.worker != cur.worker
    prompts = [o.prompt_tokens for o in outcomes if o.prompt_tokens and turn(o) > 0]
    live = live_context(by_conv, window_s if window_s is not None else max((o.at for o in outcomes), default=0.0))
    # The first 10 s fill up: the mean is over the rest of the window, where there is one.
    steady = live[20:] or live
    live_mean = sum(steady) / len(steady) if steady else None
    per_turn = Counter(turn(o) for o in outcomes if not o.error)
    return {
        "conversations": n_convs,
        "conversations_completed": log.completed,
        "turns_planned": log.planned,
        "turns_sent": log.sent,
        "ttft_p50_first": percentile(first, 50),
        "ttft_p99_first": percentile(first, 99),
        "ttft_p50_later": percentile(later, 50),
        "ttft_p99_later": percentile(later, 99),
        "moved": round(moves / follows, 4) if follows else None,
        "later_prompt_tokens_mean": round(sum(prompts) / len(prompts), 1) if prompts else None,
        "ok_per_turn": dict(sorted(per_turn.items())),
        "live_tokens_mean": None if live_mean is None else round(live_mean),
        "live_tokens_max": max(live, default=None),
        "fleet_kv_tokens": kv_tokens or None,
        "live_over_kv": round(live_mean / kv_tokens, 2) if live_mean is not None and kv_tokens else None,
    }
