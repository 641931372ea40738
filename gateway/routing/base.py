"""What every policy shares: the request's facts, the candidate filter and the decision type.

Pure code: no I/O, no framework imports. A policy ranks the workers that passed the
filters; the gateway tries them in that order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from fleetgate.schema import WorkerView

Verdict = Literal["ok", "unknown_model", "no_worker", "context_length"]


@dataclass(frozen=True, slots=True)
class RequestFacts:
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


@dataclass(frozen=True, slots=True)
class Choice:
    worker: WorkerView
    reason: str


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    choices: tuple[Choice, ...] = ()
    # For context_length: the largest max_model_len among workers serving the model.
    limit: int = 0


class Policy(Protocol):
    name: str

    def rank(
        self, candidates: Sequence[WorkerView], facts: RequestFacts, inflight: Mapping[str, int]
    ) -> list[Choice]: ...


def fits(worker: WorkerView, facts: RequestFacts) -> bool:
    if not facts.prompt_tokens:
        return True
    return facts.prompt_tokens + (facts.max_tokens or 0) <= worker.info.max_model_len or (
        # Like vLLM, an engine cuts max_tokens to what fits; only the prompt must fit.
        facts.max_tokens is None and facts.prompt_tokens < worker.info.max_model_len
    )


def decide(
    workers: Sequence[WorkerView],
    facts: RequestFacts,
    inflight: Mapping[str, int],
    policy: Policy,
    exclude: Collection[str] = (),
) -> Decision:
    """Filter the fleet for this request, then let the policy rank what is left."""
    serving = [w for w in workers if w.serves(facts.model) and w.state != "starting"]
    if not serving:
        return Decision("unknown_model")
    routable = [w for w in serving if w.routable and w.id not in exclude]
    fitting = [w for w in routable if fits(w, facts)]
    if routable and not fitting:
        return Decision("context_length", limit=max(w.info.max_model_len for w in routable))
    if not fitting:
        return Decision("no_worker")
    return Decision("ok", tuple(policy.rank(fitting, facts, inflight)))
