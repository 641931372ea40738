"""An engine's refusal of a prompt longer than its context, read from its 400.

Without the model's tokenizer the gateway only estimates a prompt's tokens, so a prompt
can reach a worker whose context is too small for it while a roomier one is idle. The
engines' refusals say the prompt's real length; with it the request is sent again where
it fits (gateway/request/attempts.py), instead of handing the client a 400 the fleet did not need.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec
from msgspec.structs import replace

from gateway.errors import ContextLengthExceeded, GatewayError, InvalidRequest, ModelNotFound
from gateway.routing import Decision, RequestFacts, Routes

# vLLM 0.32: "This model's maximum context length is 2048 tokens. However, your prompt
# contains at least 2049 input tokens, ..." (it stops counting past the limit: a lower bound,
# enough to know a worker with a longer context may fit it); older vLLM (and the simulator):
# "... However, your request has 2600 input tokens." LMDeploy: "Input length (2600) must be
# smaller than the model context length (2048)."
_PATTERNS = (
    re.compile(rb"maximum context length is \d+ tokens\. However, your prompt contains at least (\d+) input tokens"),
    re.compile(rb"maximum context length is \d+ tokens\. However, your request has (\d+) input tokens"),
    re.compile(rb"maximum context length is \d+ tokens\. However, you requested (\d+) tokens \((\d+) in"),
    re.compile(rb"Input length \((\d+)\) must be smaller than the model context length"),
)


class _Error(msgspec.Struct):
    message: str = ""


class _Body(msgspec.Struct):
    error: _Error | None = None


def refused_prompt_tokens(status: int, data: bytes) -> int | None:
    """The prompt's tokens by the engine's count (at least that many) when `data` is a
    context-length refusal (a 400 whose message says so); None for any other answer."""
    if status != 400 or b"context length" not in data:
        return None
    try:
        message = msgspec.json.decode(data, type=_Body).error
    except msgspec.DecodeError:
        return None
    if message is None:
        return None
    text = message.message.encode()
    for pattern in _PATTERNS:
        if found := pattern.search(text):
            return int(found.groups()[-1])
    return None




def error_message(data: bytes) -> str:
    """The message of an error body in OpenAI's shape."""
    try:
        error = msgspec.json.decode(data, type=_Body).error
    except msgspec.DecodeError:
        return data.decode(errors="replace")[:500]
    return error.message if error is not None else ""


def refit(facts: RequestFacts, routes: Routes, tried: Sequence[str], tokens: int) -> RequestFacts | None:
    """The request's facts with the prompt's real length, when a worker not tried yet has a
    context it fits; None when none has (the engine's refusal then stands)."""
    model_routes = routes.by_model.get(facts.model)
    if model_routes is None:
        return None
    roomier = [s for s in model_routes.slots if s.routable and s.id not in tried and s.max_len > tokens]
    if not roomier:
        return None
    max_tokens = facts.max_tokens
    if max_tokens and not any(s.max_len >= tokens + max_tokens for s in roomier):
        max_tokens = None  # the engine cuts the completion to what fits, as vLLM does
    return replace(facts, prompt_tokens=tokens, max_tokens=max_tokens)


class Refusal:
    """An engine's context-length refusal, read whole: the prompt's tokens by the engine, the
    request's facts where a worker not tried yet is roomy enough (None: none is), the message."""

    __slots__ = ("facts", "message", "tokens")

    def __init__(self, tokens: int, facts: RequestFacts | None, message: str) -> None:
        self.tokens, self.facts, self.message = tokens, facts, message


def refusal(status: int, data: bytes, facts: RequestFacts, routes: Routes, tried: Sequence[str]) -> Refusal | None:
    """`data` (an error body in OpenAI's shape) as a context-length refusal; None for any other answer."""
    if (tokens := refused_prompt_tokens(status, data)) is None:
        return None
    return Refusal(tokens, refit(facts, routes, tried, tokens), error_message(data))


__all__ = ["Refusal", "error_message", "refit", "refusal", "refused_prompt_tokens"]


def no_worker(decision: Decision, facts: RequestFacts, floor: int, path: str) -> GatewayError | None:
    """Why no worker can take the request by the decision's verdict, for the client (None: the
    attempts' own error, or a fleet with none to serve it now)."""
    model = facts.model
    if decision.verdict == "unknown_model":
        return ModelNotFound(f"The model `{model}` does not exist or no worker serves it.", param="model")
    if decision.verdict == "wrong_task":
        if facts.pooling:
            return InvalidRequest(f"`{model}` generates text; it does not serve embeddings. "
                                  "Name an embedding model.", param="model", code="model_not_supported")
        return InvalidRequest(f"`{model}` is an embedding model: it serves /v1/embeddings, not "
                              f"{path}.", param="model", code="model_not_supported")
    if decision.verdict == "context_length":
        asked = floor + (facts.max_tokens or 0)
        return ContextLengthExceeded(
            f"This model's maximum context length is {decision.limit} tokens. However, you requested "
            f"{asked} tokens or more ({floor} in the prompt, {facts.max_tokens or 0} for the "
            "completion). Please reduce the length of the prompt or of max_tokens.", param="messages")
    return None
