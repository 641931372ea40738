"""Named, seeded workloads: what each request says, and when it arrives.

A workload is two independent streams drawn from one seed:

* contents (`prefix`, `adapters`, `mixed`, `pressure`, `skew`, `pressure_long`, `lora`): an endless,
  deterministic sequence of chat requests (model, messages, max_tokens, session, tag, and
  how the answer ends);
* arrivals: a bursty Poisson process, or a plain Poisson one for the tenant workloads
  (fleetgate_tools/bench/arrivals.py).

Contents do not depend on the rate, so the load generator can first look at the shape of
the requests (their token counts), estimate the fleet's capacity for them, and only then
draw arrival times at the wanted fraction of it. A finished workload is a list of
`BenchRequest`s, which round-trips through a JSONL trace (`write_trace`/`read_trace`).

Token counts are sized for the simulator's byte tokenizer (one token per 4 bytes of UTF-8).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

BYTES_PER_TOKEN = 4


class BenchRequest(msgspec.Struct, kw_only=True, frozen=True):
    """One request of a workload, as sent and as stored in a trace line."""

    id: int
    at: float  # seconds after the run starts
    model: str
    messages: list[dict[str, str]]
    max_tokens: int
    session: str | None = None
    # Free-form label for breakdowns: "turn-3", "long", "lora-07", ...
    tag: str = ""
    # Exact token counts (the engine generates max_tokens): the same work for every policy.
    # False for workloads whose answers end before max_tokens (`pressure_long`).
    ignore_eos: bool = True
    # > 0: the client reads this many generated tokens, then closes the stream (the gateway
    # cancels the engine's request); 0: it reads to the end. See `tenant_contents`.
    answer_tokens: int = 0
    # More body fields (e.g. vLLM's min_tokens and logit_bias), sent as they are.
    extra: dict[str, Any] = msgspec.field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self.messages,
            "max_tokens": self.max_tokens,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.extra,
        }
        if self.session:
            body["user"] = self.session
        return body

    def prompt_tokens(self) -> int:
        """The simulator's byte estimate of the rendered chat prompt."""
        size = sum(len(m["role"]) + len(m["content"].encode()) + 24 for m in self.messages)
        return math.ceil((size + 22) / BYTES_PER_TOKEN)


@dataclass(frozen=True, kw_only=True)
class FleetFacts:
    """What a workload needs to know of the fleet."""

    model: str
    adapters: Sequence[str] = ()
    # The largest and smallest max_model_len in the fleet.
    max_context: int = 32768
    min_context: int = 4096


# ---------------------------------------------------------------- text

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which "
    "she do how their if will up other about out many then them these so some her would make "
    "like him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part "
    "router cache prefix engine token batch queue latency adapter kernel tensor gradient"
).split()


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of text (the byte tokenizer's count)."""
    out: list[str] = []
    size = 0
    target = tokens * BYTES_PER_TOKEN
    while size < target:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def zipf_weights(n: int, s: float) -> list[float]:
    raw = [1.0 / (k**s) for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def _pick(rng: random.Random, cumulative: Sequence[float]) -> int:
    import bisect

    return min(bisect.bisect_left(cumulative, rng.random()), len(cumulative) - 1)


# ---------------------------------------------------------------- contents


@dataclass(frozen=True, kw_only=True)
class Draft:
    """A request before it has an arrival time."""

    model: str
    messages: list[dict[str, str]]
    max_tokens: int
    session: str | None = None
    tag: str = ""
    ignore_eos: bool = True
    answer_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


ContentGen = Callable[[random.Random, FleetFacts, dict[str, Any]], Iterator[Draft]]


def prefix_contents(rng: random.Random, fleet: FleetFacts, p: dict[str, Any]) -> Iterator[Draft]:
    """Multi-turn chat sessions; each session opens with one of a few long system prompts.

    A new request starts a session with probability 1/mean_turns, else continues a random
    open one; a turn carries the whole conversation so far (earlier answers are synthetic
    text the size of max_tokens, so the trace does not depend on what an engine answered).
    """
    n_prompts = int(p.get("system_prompts", 48))
    sys_tokens = int(p.get("system_tokens", 1200))
    user_tokens = int(p.get("user_tokens", 80))
    mean_turns = float(p.get("mean_turns", 4))
    max_turns = int(p.get("max_turns", 8))
    max_tokens = int(p.get("max_tokens", 32))
    open_sessions = int(p.get("open_sessions", 32))
    prompts = [
        f"[system prompt {i}] " + words(random.Random(rng.random()), sys_tokens)
        for i in range(n_prompts)
    ]
    cumulative = list(itertools.accumulate(zipf_weights(n_prompts, float(p.get("zipf", 0.6)))))
    # Open sessions: (id, conversation so far, turns it will have).
    sessions: list[tuple[str, list[dict[str, str]], int]] = []
    counter = itertools.count()
    while True:
        if not sessions or (len(sessions) < open_sessions and rng.random() < 1 / mean_turns):
            sid = f"s{next(counter):05d}"
            system = prompts[_pick(rng, cumulative)]
            turns = min(max_turns, 1 + int(rng.expovariate(1 / max(mean_turns - 1, 0.01))))
            sessions.append((sid, [{"role": "system", "content": system}], turns))
            k = len(sessions) - 1
        else:
            k = rng.randrange(len(sessions))
        sid, history, turns = sessions[k]
        turn = (len(history) - 1) // 2 + 1
        messages = [*history, {"role": "user", "content": words(rng, user_tokens)}]
        yield Draft(model=fleet.model, messages=messages, max_tokens=max_tokens, session=sid,
                    tag=f"turn-{turn}")  # fmt: skip
        if turn >= turns:
            sessions.pop(k)
        else:
            answer = {"role": "assistant", "content": words(rng, max_tokens)}
            sessions[k] = (sid, [*messages, answer], turns)


def adapter_contents(rng: random.Random, fleet: FleetFacts, p: dict[str, Any]) -> Iterator[Draft]:
    """Single-turn requests to many LoRA adapters with Zipf popularity (rank = list order)."""
    adapters = list(fleet.adapters)
    if not adapters:
        raise ValueError("the adapters workload needs adapters in the fleet")
    cumulative = list(itertools.accumulate(zipf_weights(len(adapters), float(p.get("zipf", 1.0)))))
    lo, hi = int(p.get("prompt_min", 100)), int(p.get("prompt_max", 400))
    max_tokens = int(p.get("max_tokens", 32))
    while True:
        name = adapters[_pick(rng, cumulative)]
        content = words(rng, rng.randint(lo, hi))
        yield Draft(model=name, messages=[{"role": "user", "content": content}],
                    max_tokens=max_tokens, tag=name)  # fmt: skip


def mixed_contents(rng: random.Random, fleet: FleetFacts, p: dict[str, Any]) -> Iterator[Draft]:
    """Short prompts, medium ones that fit every worker, and long ones that fit only the
    long-context workers (over the smallest max_model_len, under the largest)."""
    max_tokens = int(p.get("max_tokens", 32))
    long_share = float(p.get("long_share", 0.1))
    medium_share = float(p.get("medium_share", 0.2))
    small = fleet.min_context
    long_hi = min(int(p.get("long_max", 12000)), fleet.max_context - max_tokens - 64)
    long_lo = min(small + 256, long_hi)
    while True:
        roll = rng.random()
        if roll < long_share:
            n, tag = rng.randint(long_lo, long_hi), "long"
        elif roll < long_share + medium_share:
            n, tag = rng.randint(small // 2, small - max_tokens - 256), "medium"
        else:
            n, tag = rng.randint(50, 400), "short"
        yield Draft(model=fleet.model, messages=[{"role": "user", "content": words(rng, n)}],
                    max_tokens=max_tokens, tag=tag)  # fmt: skip


def tenant_contents(rng: random.Random, fleet: FleetFacts, p: dict[str, Any]) -> Iterator[Draft]:
    """Tenants, each with its own long system prompt; every request is that prompt plus a
    unique question, tagged `tenant-<i>` (the tag is not sent: only client-side strategies
    see it). `hot_share` > 0 gives tenant 0 that share of the traffic, the rest split evenly.

    The defaults (16 x ~1,500 tokens of system prompt, ~65-token questions, 64 output
    tokens) are issue 14's KV-pressure workload: the prefixes fill ~70% of a 33.7k-token
    cache, so they fit two such workers but not one.

    `zipf` > 0 gives tenant t a share of the traffic proportional to 1/(t+1)^zipf instead
    (issue 36's `lora`: Zipf 1.0), and `adapter_prefix` makes tenant t call the LoRA adapter
    `<prefix><t>` instead of the base model (tenant t's adapter is then "a{t}").

    `answer_tokens` > 0 (issue 31's `pressure_long`: max_tokens 4096, answers of 64) makes
    the requests declare far more than they use, as real clients do: no ignore_eos, and the
    answer ends after `answer_tokens` tokens by `answer_end`:

    * `client` (the default; the same on the simulator and on vLLM): the load generator
      reads `answer_tokens` tokens, then closes the stream, and the gateway cancels the
      engine's request. Neither engine can be told to stop at a given length in a way the
      other honours: the simulator's natural stop is a seeded geometric draw (mean 200
      tokens; workers/simulator/engine.py `eos_after`) and it ignores `min_tokens`,
      `logit_bias` and `stop_token_ids`; vLLM with random weights almost never samples EOS
      (1 in ~8,000 a token). Answers the simulator ends earlier by its natural stop count
      as engine stops (about 27% of them end before 64 tokens).
    * `engine` (vLLM only): the engine ends the answer itself: `min_tokens` =
      answer_tokens - 1 keeps EOS (and stop tokens) masked until then, and `logit_bias`
      {eos_token_id: 100} makes EOS the next token, so vLLM finishes with reason "stop"
      after exactly answer_tokens tokens (the EOS counted). The client still cuts at
      answer_tokens + `guard_tokens` (16) should an engine ignore those fields (the
      simulator does), and the report counts how each answer ended.
    """
    n = int(p.get("tenants", 16))
    sys_tokens = int(p.get("system_tokens", 1500))
    user_tokens = int(p.get("user_tokens", 65))
    max_tokens = int(p.get("max_tokens", 64))
    hot = float(p.get("hot_share", 0.0))
    zipf = float(p.get("zipf", 0.0))
    adapter = p.get("adapter_prefix")
    if n < 1 or not 0.0 <= hot < 1.0 or zipf < 0 or (hot and zipf):
        raise ValueError("tenant workloads need tenants >= 1, 0 <= hot_share < 1, zipf >= 0, not both")
    answer = answer_shape(p, max_tokens)
    prompts = [
        f"[tenant {i}] " + words(random.Random(rng.random()), sys_tokens) for i in range(n)
    ]
    if hot and n > 1:
        weights = [hot] + [(1 - hot) / (n - 1)] * (n - 1)
    elif zipf:
        weights = zipf_weights(n, zipf)
    else:
        weights = [1 / n] * n
    cumulative = list(itertools.accumulate(weights))
    for k in itertools.count():
        t = _pick(rng, cumulative)
        # The number makes every question unique (a cache hit beyond the system prompt
        # would flatter whichever strategy happened to repeat it).
        head = f"question {k}: "
        question = head + words(rng, max(1, user_tokens - len(head) // BYTES_PER_TOKEN))
        messages = [{"role": "system", "content": prompts[t]}, {"role": "user", "content": question}]
        model = f"{adapter}{t}" if adapter else fleet.model
        yield Draft(model=model, messages=messages, max_tokens=max_tokens, tag=f"tenant-{t}", **answer)


ANSWER_ENDS = ("client", "engine")


def answer_shape(p: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """Draft fields for an answer shorter than max_tokens (`answer_tokens` in the params),
    ended as `answer_end` says (tenant_contents has the meaning); {} for exact answers."""
    answer = int(p.get("answer_tokens", 0))
    if answer <= 0:
        return {}
    end = str(p.get("answer_end", "client"))
    if end not in ANSWER_ENDS:
        raise ValueError(f"unknown answer_end {end!r}; known: {', '.join(ANSWER_ENDS)}")
    if answer >= max_tokens:
        raise ValueError("answer_tokens must be below max_tokens")
    if end == "client":
        return {"ignore_eos": False, "answer_tokens": answer}
    eos = int(p.get("eos_token_id", 1))  # <|eos|> of ../shared/gpu/make_config_model.py's tokenizer
    guard = int(p.get("guard_tokens", 16))
    return {"ignore_eos": False, "answer_tokens": min(max_tokens, answer + guard),
            "extra": {"min_tokens": answer - 1, "logit_bias": {str(eos): 100}}}


def _with_defaults(gen: ContentGen, **defaults: Any) -> ContentGen:
    def wrapped(rng: random.Random, fleet: FleetFacts, p: dict[str, Any]) -> Iterator[Draft]:
        return gen(rng, fleet, {**defaults, **p})

    wrapped.__doc__ = gen.__doc__
    return wrapped


WORKLOADS: dict[str, ContentGen] = {
    "prefix": prefix_contents,
    "adapters": adapter_contents,
    "mixed": mixed_contents,
    "pressure": _with_defaults(tenant_contents, hot_share=0.0),
    "skew": _with_defaults(tenant_contents, hot_share=0.4),
    # Issue 31: the pressure workload, but each request declares max_tokens 4096 and the
    # answer ends after ~64 tokens (a gateway that holds max_tokens of KV per request
    # counts 64x what the engines use).
    "pressure_long": _with_defaults(tenant_contents, hot_share=0.0, max_tokens=4096, answer_tokens=64),
    # Issue 36: 16 tenants, tenant t calls LoRA adapter a{t}, Zipf(1.0) popularity.
    "lora": _with_defaults(tenant_contents, hot_share=0.0, zipf=1.0, adapter_prefix="a"),
}
# What `scripts/bench_fleet.py` runs when no --workloads are given: the tenant workloads
# are sized for their own fleets (config/bench/pressure.yaml, ample.yaml).
DEFAULT_WORKLOADS = ("prefix", "adapters", "mixed")



def contents(
    name: str, seed: int, fleet: FleetFacts, params: dict[str, Any] | None = None
) -> Iterator[Draft]:
    try:
        gen = WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None
    # One RNG per (workload, seed), independent of the arrival RNG.
    return gen(random.Random(f"{name}:{seed}"), fleet, dict(params or {}))


def build(drafts: Iterator[Draft], times: Sequence[float]) -> list[BenchRequest]:
    return [
        BenchRequest(id=i, at=round(at, 6), model=d.model, messages=d.messages,
                     max_tokens=d.max_tokens, session=d.session, tag=d.tag, ignore_eos=d.ignore_eos,
                     answer_tokens=d.answer_tokens, extra=d.extra)
        for i, (at, d) in enumerate(zip(times, drafts, strict=False))
    ]


# ---------------------------------------------------------------- traces

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(BenchRequest)


def write_trace(path: str | Path, requests: Sequence[BenchRequest]) -> None:
    with open(path, "wb") as fh:
        for req in requests:
            fh.write(_encoder.encode(req) + b"\n")


def read_trace(path: str | Path) -> list[BenchRequest]:
    with open(path, "rb") as fh:
        reqs = [_decoder.decode(line) for line in fh if line.strip()]
    return sorted(reqs, key=lambda r: r.at)
