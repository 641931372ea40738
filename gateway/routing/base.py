"""What every policy shares: the candidate filter and `decide` (the records: routing/records.py).

Pure code: no I/O, no framework imports. `decide` filters the workers that serve
the model (precomputed per snapshot in `Routes`), then the policy ranks the top few;
the gateway tries them in that order.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from gateway.routing.homes import Homes
from gateway.routing.records import Choice, Decision, RequestFacts
from gateway.routing.table import ModelRoutes, Routes, Slot

# How many ranked workers a decision returns: the first choice plus retries.
DEFAULT_LIMIT = 3

_T = TypeVar("_T", bound="tuple[Any, ...]")


def best(keyed: list[_T], limit: int) -> list[_T]:
    """The `limit` smallest, in order (min() for the usual single choice: no heap)."""
    if not keyed:
        return []
    return [min(keyed)] if limit == 1 else heapq.nsmallest(limit, keyed)


@dataclass(frozen=True, slots=True)
class Live:
    """The gateway's own account of the fleet, fresh (the snapshot's engine figures are up to a
    second old): requests in flight per worker and the KV tokens they hold, summed over every
    gateway replica, and where affinity keys are placed. The mappings are live views, read
    at decision time."""

    requests: Mapping[str, int]
    tokens: Mapping[str, int] = field(default_factory=dict)
    # Where affinity keys live and the work placed on each worker (gateway/routing/homes.py);
    # None: no placement (a new key goes by load alone).
    homes: Homes | None = None
    # How the KV each engine holds changed since its last report, by the gateways' estimate:
    # what the requests sent since take, less what those that ended since free
    # (gateway/accounts/inflight.py). Added to the engine's measured KV use, it predicts between two
    # reports; each report replaces the prediction.
    fresh: Mapping[str, int] = field(default_factory=dict)
    # Prompt tokens each worker's engine has still to prefill for the streamed requests sent
    # to it whose first token has not come, less what it held of each when it was sent (its
    # queue of prefill work, which its KV use does not show): gateway/accounts/inflight.py.
    pending: Mapping[str, int] = field(default_factory=dict)

    @staticmethod
    def of(inflight: Mapping[str, int] | Live) -> Live:
        return inflight if type(inflight) is Live else Live(inflight)  # type: ignore[arg-type]


def kv_in_use(slot: Slot, live: Live) -> float:
    """The KV tokens `slot`'s engine holds now: its own measured figure plus what its last report
    does not cover yet; where the engine measures none, the gateway's account of its requests
    (each one's prompt and whole completion budget)."""
    if slot.measured:
        held = slot.kv_held + live.fresh.get(slot.id, 0)
        return held if held > 0.0 else 0.0
    return live.tokens.get(slot.id, 0)


@dataclass(frozen=True, slots=True)
class FullAt:
    """When a worker counts as full, for load shedding and holding.

    What the engine measures is the truth: where it reports its KV use, a worker is full by
    that figure (plus the prediction since the report, and its own queue), never by the
    completion budgets the gateway has sent it. A second-old gauge never sheds on its own
    either: a worker with free sequence slots by the gateway's account and KV room by its
    engine's report is never full. Where the engine reports no KV use, the gateway's
    account (each request's prompt and whole completion budget) stands in.
    """

    # Requests in flight at or above capacity x (1 + queue_ratio), or (where the engine's
    # KV size is known) KV demand at or above its cache x (1 + queue_ratio): what the engine
    # holds and what it queues.
    queue_ratio: float = 1.0
    # Where the KV size is unknown: at capacity by the account, and the engine reports a
    # queue with its cache this full.
    kv: float = 0.98
    # Hold a request in the gateway, briefly, rather than send it to a worker whose KV cache
    # it would push past this share (0: never): an engine that admits more than its cache
    # holds preempts running requests to make room. 0 turns it off.
    hold_kv: float = 1.0
    # The share of that limit a request's priority class may fill (gateway/accounts/priorities.py):
    # below 1 its class counts a worker full earlier, leaving room for the classes above.
    share: float = 1.0

    def holds(self, slot: Slot, live: Live, tokens: int) -> bool:
        """True when `tokens` more would take `slot` past `hold_kv` of its KV cache, while it
        has requests in flight (their completions make room). `tokens`: what the request takes
        until the next report where the engine measures its KV, else its whole account."""
        if not self.hold_kv or not slot.kv_tokens or not live.requests.get(slot.id, 0):
            return False
        return kv_in_use(slot, live) + tokens > self.hold_kv * slot.kv_tokens

    def why(self, slot: Slot, live: Live) -> str | None:
        """The limit `slot` is at ("slots", "kv"), or None when it has room."""
        requests = live.requests.get(slot.id, 0)
        share = self.share
        if requests >= slot.capacity * (1.0 + self.queue_ratio) * share:
            return "slots"
        if slot.measured:
            # What it holds, and its queue: each waiting request sized like its running ones
            # (the engine's figures both; the completion budgets sent say nothing of either).
            queued = slot.waiting * slot.kv_held / max(slot.running, 1) if slot.waiting else 0.0
            demand = kv_in_use(slot, live) + queued
            return "kv" if demand >= slot.kv_tokens * (1.0 + self.queue_ratio) * share else None
        if slot.kv_tokens:
            return "kv" if live.tokens.get(slot.id, 0) >= slot.kv_tokens * (1.0 + self.queue_ratio) * share else None
        if requests >= slot.capacity * share and slot.waiting > 0 and slot.kv >= self.kv:
            return "kv"
        return None

    def full(self, slot: Slot, live: Live) -> bool:
        return self.why(slot, live) is not None


class Policy(Protocol):
    name: str

    def rank(
        self, candidates: Sequence[Slot], facts: RequestFacts, live: Live, routes: ModelRoutes, limit: int,
    ) -> list[Choice]:
        """The best `limit` candidates, best first, each with the reason it was chosen."""
        ...


def decide(
    routes: Routes,
    facts: RequestFacts,
    inflight: Mapping[str, int] | Live,
    policy: Policy,
    exclude: Collection[str] = (),
    limit: int = DEFAULT_LIMIT,
    full_at: FullAt | None = None,
) -> Decision:
    """Filter the workers serving this model, then let the policy rank what is left.

    With `full_at`, a request whose every eligible worker is full is `saturated`
    (the gateway holds it back) instead of ranked. `inflight` is the requests in flight per
    worker, or the gateway's whole live account (`Live`).
    """
    live = Live.of(inflight)
    model_routes = routes.by_model.get(facts.model)
    if model_routes is None:
        return Decision("unknown_model")
    routable = _routable(model_routes, facts, exclude)
    if not routable:
        return Decision("no_worker")
    if facts.pooling is not None and model_routes.pooling is not facts.pooling:
        # Only where the workers serving this name are of both kinds (or it is pinned)
        # does this filter; otherwise they all are, or none is, what the request needs.
        routable = [s for s in routable if s.pooling == facts.pooling]
        if not routable:
            return Decision("wrong_task")
    fitting = _fitting(routable, facts, model_routes)
    if not fitting:
        return Decision("context_length", limit=max(s.max_len for s in routable))
    if facts.pinned is not None:  # one candidate: nothing for the policy to weigh
        choices: tuple[Choice, ...] = (Choice(fitting[0], "response-pinned"),)
    else:
        choices = tuple(policy.rank(fitting, facts, live, model_routes, limit))
    # Cheap in the common case: only when the policy's pick is full are the others checked.
    if full_at is not None and (why := full_at.why(choices[0].slot, live)) and all(
        full_at.full(s, live) for s in fitting
    ):
        return Decision("saturated", why=why)
    return Decision("ok", choices)


def _routable(model_routes: ModelRoutes, facts: RequestFacts, exclude: Collection[str]) -> Sequence[Slot]:
    """The workers the request may go to, less those excluded: the one it is pinned to while no
    circuit breaker took it out (draining or not), else the model's routable ones."""
    if facts.pinned is not None:
        pinned = facts.pinned
        return [s for s in model_routes.slots if s.id == pinned and s.id not in exclude and not s.view.circuit]
    if exclude:
        return [s for s in model_routes.routable if s.id not in exclude]
    return model_routes.routable


def _fitting(routable: Sequence[Slot], facts: RequestFacts, model_routes: ModelRoutes) -> Sequence[Slot]:
    """Those of `routable` whose context fits the request (none: it fits none of them)."""
    need = facts.prompt_tokens
    if not need or (need + (facts.max_tokens or 0) <= model_routes.min_len and facts.pinned is None):
        return routable  # fits every routable worker (these are among them): nothing to filter
    # Like vLLM, an engine cuts max_tokens to what fits; the prompt itself must fit,
    # and where the client asked for a completion length, that should fit too.
    total = need + (facts.max_tokens or 0)
    return [s for s in routable if s.max_len >= total] or (
        [s for s in routable if s.max_len > need] if facts.max_tokens is None else []
    )
