"""Model aliases and fallbacks: which model a request is sent to, and where it goes next.

An alias is a public model name for one or more fleet models (base models or LoRA
adapters), each with a weight: `chat: [{model: base-7b, weight: 90}, {model: tuned, weight: 10}]`
sends about 90% of `chat` requests to `base-7b` and 10% to the adapter `tuned`. The choice
is a pure function of the alias and the request's affinity key, so every gateway replica
makes the same one: the key is the session (`x-session-id`, else the body's `user`) when
the request has one, which keeps a user's conversation on one variant (a canary sees whole
sessions); else the request id, which spreads requests by the weights.

A fallback list names, in order, the models a request is sent to when its own has no
capacity (every worker full, 429/503 or unreachable, or no worker serves it at all) or
when its prompt does not fit the context of any of its workers. The list is not followed
transitively: `a: [b]` and `b: [c]` send a request for `a` to `b` only. A request for an
alias follows its chosen model's list, then the alias's own; a fallback that is itself an
alias resolves to one of its models with the same key.

Nothing here does I/O: `resolve` is a function of the routes (the YAML's overlaid by the live
ones, gateway/models/live_routes.py) and the key, `fallback_reason`
of an error; gateway/request/proxy.py applies them (the body's `model` is rewritten to the chosen one,
so the engine answers with, and the response names, the real model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from fleetgate.hashing import stable_hash
from gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    ModelNotFound,
    NoWorkerAvailable,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
)

_SPAN = float(1 << 64)


class AliasTarget(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One model of an alias and its share of the alias's traffic (relative to the others')."""

    model: str
    weight: float = 1.0


Aliases = Mapping[str, Sequence[AliasTarget]]
Fallbacks = Mapping[str, Sequence[str]]


@dataclass(frozen=True, slots=True)
class Route:
    """The models to try for one request, in order, and the alias it named (None: a model)."""

    models: tuple[str, ...]
    alias: str | None = None


def problems(aliases: Aliases, fallbacks: Fallbacks) -> list[str]:
    """What is wrong with the `aliases` and `fallbacks` settings, one line each ([]: nothing)."""
    out: list[str] = []
    for name, targets in aliases.items():
        out += _alias_problems(name, targets, aliases)
    for model, chain in fallbacks.items():
        out += _fallback_problems(model, chain)
    return out


def _alias_problems(name: str, targets: Sequence[AliasTarget], aliases: Aliases) -> list[str]:
    out: list[str] = []
    if not targets:
        out.append(f"alias `{name}` names no model")
    for t in targets:
        if not t.model:
            out.append(f"alias `{name}` has a target with an empty `model`")
        elif t.model in aliases:
            out.append(f"alias `{name}` names another alias `{t.model}`; name models or adapters only")
        if not t.weight >= 0:  # 0: listed, gets no traffic (a canary switched off)
            out.append(f"alias `{name}`: the weight of `{t.model}` must be 0 or above, got {t.weight}")
    if targets and all(t.weight >= 0 for t in targets) and not any(t.weight > 0 for t in targets):
        out.append(f"alias `{name}`: at least one weight must be above 0")
    return out


def _fallback_problems(model: str, chain: Sequence[str]) -> list[str]:
    out: list[str] = []
    if not chain:
        out.append(f"fallbacks of `{model}` is empty")
    for fallback in chain:
        if fallback == model:
            out.append(f"`{model}` names itself as its fallback")
        elif not fallback:
            out.append(f"fallbacks of `{model}` has an empty name")
    return out


def pick(targets: Sequence[AliasTarget], key: str, alias: str) -> str:
    """The model of `targets` for `key`: each wins for its weight's share of keys."""
    total = sum(t.weight for t in targets)
    point = stable_hash("alias", alias, key) / _SPAN * total
    for t in targets:
        point -= t.weight
        if point < 0:
            return t.model
    # Float rounding at the very top of the range: the last target that gets traffic.
    return next((t.model for t in reversed(targets) if t.weight > 0), targets[-1].model)


def resolve(aliases: Aliases, fallbacks: Fallbacks, model: str, key: str) -> Route:
    """The models a request for `model` with affinity `key` is sent to, first to last."""
    if model not in fallbacks and model not in aliases:
        return Route((model,))  # the common case, on every request: no work
    targets = aliases.get(model)
    if targets is None:
        chain = [model, *fallbacks.get(model, ())]
        alias = None
    else:
        chosen = pick(targets, key, model)
        chain = [chosen, *fallbacks.get(chosen, ()), *fallbacks.get(model, ())]
        alias = model
    out: list[str] = []
    for name in chain:
        real = pick(aliases[name], key, name) if name in aliases else name
        if real not in out:
            out.append(real)
    return Route(tuple(out), alias)


def fallback_reason(error: GatewayError) -> str | None:
    """Why `error` sends a request on to its model's fallback: `no_capacity`, `no_model` or
    `context_length`; None when a fallback would not help (a bad request, a slow engine)."""
    if isinstance(error, ContextLengthExceeded):
        return "context_length"
    if isinstance(error, ModelNotFound):
        return "no_model"
    if isinstance(error, Overloaded | NoWorkerAvailable):
        return "no_capacity"
    if isinstance(error, UpstreamError) and not isinstance(error, UpstreamTimeout):
        return "no_capacity"  # every worker tried refused or failed (503s, connection refused)
    return None


def with_model(body: bytes, model: str) -> bytes:
    """The request body with its `model` replaced (a JSON object: parse_request checked it)."""
    data = msgspec.json.decode(body)
    data["model"] = model
    return msgspec.json.encode(data)


def listed(aliases: Aliases, models_json: bytes) -> bytes:
    """`/v1/models` with the aliases added, each as a model owned by fleetgate (its `parent`
    is null, its targets are listed in `fleetgate_alias_of`)."""
    if not aliases:
        return models_json
    data = msgspec.json.decode(models_json)
    served = {m["id"] for m in data["data"]}
    for name, targets in sorted(aliases.items()):
        if name in served:
            continue
        data["data"].append({"id": name, "object": "model", "created": 0, "owned_by": "fleetgate",
                             "parent": None, "fleetgate_alias_of": [t.model for t in targets]})
    return msgspec.json.encode(data)


__all__ = ["AliasTarget", "Route", "fallback_reason", "listed", "pick", "problems", "resolve", "with_model"]
