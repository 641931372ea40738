"""The routing records: a request's facts, a decision and its choices, the fleet policy's
options. Frozen msgspec Structs: immutable as a dataclass(frozen=True), and built in C.

They live apart from the code that uses them because that code is compiled with mypyc
(scripts/compile.py), which keeps a class's annotations only as plain types, and msgspec
reads them (FleetOptions is decoded from the settings). This module stays Python.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.routing.table import Slot

Verdict = Literal["ok", "unknown_model", "no_worker", "wrong_task", "context_length", "saturated"]


# A frozen dataclass would set each field through object.__setattr__; RequestFacts has 16.
class RequestFacts(msgspec.Struct, frozen=True):
    model: str
    # Estimated prompt tokens; 0 when unknown (then max_model_len does not filter).
    prompt_tokens: int = 0
    max_tokens: int | None = None
    session: str | None = None
    # The gateway's request counter; round-robin and random use it, nothing else should.
    seq: int = 0
    # True when `model` names a LoRA adapter rather than a base model.
    adapter: bool = False
    # Stable hash of what this request shares with others (a system prompt, a session);
    # requests with the same key are sent to the same worker while its load allows.
    affinity_key: int | None = None
    affinity_kind: str | None = None
    # For an adapter: workers where it is likely in a LoRA slot (this gateway sent it
    # there recently, and not more than the worker's slots of other adapters since),
    # and workers whose slots are likely all taken (a load there evicts another adapter).
    warm: frozenset[str] = frozenset()
    full: frozenset[str] = frozenset()
    # The one worker that can serve this request (it stores the response a Responses API
    # follow-up continues). It takes the request while draining too: the conversation
    # lives there, and a drain lets requests finish.
    pinned: str | None = None
    # True for embeddings (only embedding models serve them), False for the routes that
    # generate text (embedding models cannot), None when either will do (/tokenize).
    pooling: bool | None = None
    # Tokens of the shared part the affinity key stands for (a system prompt).
    prefix_tokens: int = 0
    # The key those tokens are shared under in the KV account, where it is not the affinity
    # key: an adapter's requests meet by adapter, but share KV blocks by system prompt (one
    # adapter's tenants may each have their own).
    prefix_key: int | None = None
    # Where the gateway has placed this affinity key (gateway/routing/homes.py), and its
    # second home while it has one; None for a key not placed yet.
    home: str | None = None
    second: str | None = None
    # The key carries a large share of its home's placed work (a hot tenant): only such a
    # key may get a second home when its home saturates. Light keys stay home, so a busy
    # worker does not spread all of its tenants over the fleet (which thrashes every cache).
    heavy: bool = False
    # Prompt tokens each worker's engine holds in its prefix cache, by its KV cache events
    # (gateway/request/prefix_cache.py); only workers whose index is known (0: it holds none
    # of the prompt). Empty: nothing known.
    cached: dict[str, int] = msgspec.field(default_factory=dict)


class Choice(msgspec.Struct, frozen=True):
    slot: Slot
    reason: str

    @property
    def worker(self):  # type: ignore[no-untyped-def]  # -> WorkerView
        return self.slot.view


class Decision(msgspec.Struct, frozen=True):
    verdict: Verdict
    choices: tuple[Choice, ...] = ()
    # For context_length: the largest max_model_len among workers serving the model.
    limit: int = 0
    # For saturated: the limit the first choice is at ("slots", "kv").
    why: str = ""


class FleetOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    # Placed work per unit of capacity this far apart (x the mean) moves a key off the
    # busier worker (gateway/routing/homes.py).
    balance: float = 0.25
    # A home whose KV cache is this full by the gateway's account is saturated.
    kv_high: float = 0.9
    # Relative spread of the random tie-break between near-equal workers.
    jitter: float = 0.05
    # Weight of engine-reported work beyond the gateways' own in-flight count (other clients').
    foreign_weight: float = 0.5
    # A key doing this share of its home's placed work is heavy: it may get a second home.
    heavy_share: float = 0.3
    # A second home must be this much less loaded than the saturated home.
    spill_margin: float = 0.1
    # How long a key keeps its second home after its home was last saturated, and the
    # half-life of the work by which keys are placed.
    second_hold_s: float = 10.0
    half_life_s: float = 30.0
    # How much busier (seats per unit of capacity) a hot adapter's engine must be than one
    # with a free LoRA slot before the adapter is spread there too.
    lora_load_cost: float = 0.3
    # No longer read (an engine whose slots are all busy with others is taken only when no
    # engine has a free slot: a rule, not a cost); accepted so that old configs still load.
    lora_swap_cost: float = 1.5
    # Route by what the engines report they cache (their KV cache events, where a worker
    # publishes them and the model's tokenizer is known), not only by the placement.
    kv_events: bool = True
    # A worker whose engine holds more of the prompt than the key's home does takes the
    # request when it saves at least this share of what the home would compute again.
    kv_gain: float = 0.3
    # Where the engines' holdings are known: a request goes to another worker when, by the
    # prefill queued there (the streams sent whose first token has not come, `Live.pending`)
    # plus what it would prefill of this prompt, its first token comes sooner by at least
    # this share of the prompt's prefill (0: never). Caches that keep a conversation home
    # do not help a turn that waits behind a queue of prefills.
    prefill_margin: float = 0.25
    # ...and only to a worker whose KV cache, with this request's uncached tokens, stays below
    # this share of its size: a copy of a prefix on a fuller cache evicts others' prefixes and
    # tips it into preemption (where tenants' prefixes fill the caches, the queue is not
    # worth it).
    sooner_kv_max: float = 0.75
