"""The request bodies of the OpenAPI document (gateway/api/openapi.py), as JSON Schemas.

The OpenAI routes' bodies are described by the Structs below, with the constraints the
gateway (gateway/request/requests.py) and vLLM-like engines enforce; fields engines take beyond
these pass through untouched. The admin bodies are the Structs the handlers decode
(gateway/tenants/tenants.py, gateway/models/live_routes.py; gateway/api/admin.py's, written out), with the checks those
handlers make written into the schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gateway.models.live_routes import AliasSpec, FallbackSpec
from gateway.tenants.tenants import KeySpec, TeamSpec

NonEmpty = Annotated[str, Meta(min_length=1)]
Tokens = Annotated[int, Meta(ge=1)]
# vLLM's sampling ranges.
Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
Choices = Annotated[int, Meta(ge=1, le=16384)]


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (engines accept more; those pass through untouched)."""

    model: NonEmpty
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Tokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Choices | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Tokens | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: NonEmpty | Annotated[list[NonEmpty], Meta(min_length=1)]
    n: Choices = 1  # vLLM's completions take no null here (chat does)


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    type: Literal["message"] = "message"


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The Responses API (vLLM's subset of OpenAI's: text in, text out)."""

    model: NonEmpty
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: Tokens | None = None
    # Continue a stored response: the request goes to the worker that stores it.
    previous_response_id: NonEmpty | None = None
    # Whether the engine keeps the response for follow-ups, retrieve and cancel (false or null: not).
    store: bool | None = True
    stream: bool = False
    temperature: Temperature | None = None
    top_p: TopP | None = None
    user: str | None = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    model: NonEmpty
    input: NonEmpty | Annotated[list[NonEmpty], Meta(min_length=1)]
    # vLLM's `bytes` and `bytes_only` answer raw vectors (and a `metadata` header), which the
    # gateway does not relay: it refuses them (gateway/wire.py `Embeddings`).
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Tokens | None = None
    user: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""

    model: NonEmpty
    prompt: str | None = None
    messages: list[ChatMessage] = []
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: NonEmpty
    tokens: list[Annotated[int, Meta(ge=0)]]


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


def schema_of(kind: Any) -> dict[str, Any]:
    """`kind`'s JSON Schema with every $ref replaced by its definition (none is recursive)."""
    (schema,), defs = msgspec.json.schema_components([kind], ref_template="#/$defs/{name}")
    return _inline(schema, defs)  # type: ignore[no-any-return]


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            return _inline(defs[ref.rsplit("/", 1)[1]], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "title"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


def _sampling(kind: type[_Sampling]) -> dict[str, Any]:
    schema = schema_of(kind)
    # vLLM: greedy sampling (temperature under 1e-5) makes one choice only.
    schema["if"] = {"required": ["temperature"],
                    "properties": {"temperature": {"type": "number", "exclusiveMaximum": 1e-5}}}
    schema["then"] = {"properties": {"n": {"maximum": 1}}}
    return schema


def _tokenize() -> dict[str, Any]:
    schema = schema_of(TokenizeRequest)
    del schema["properties"]["messages"]["default"]
    # vLLM's is a union: a prompt (and no `messages`), or messages (a prompt beside them is ignored).
    schema["anyOf"] = [{"required": ["prompt"], "not": {"required": ["messages"]},
                        "properties": {"prompt": {"type": "string"}}},
                       {"required": ["messages"]}]
    return schema


# Per proxied route kind (gateway/request/requests.py KINDS): its body's schema.
PROXIED_BODIES: dict[str, dict[str, Any]] = {
    "chat": _sampling(ChatCompletionRequest),
    "completion": _sampling(CompletionRequest),
    "responses": schema_of(ResponsesRequest),
    "embeddings": schema_of(EmbeddingsRequest),
    "tokenize": _tokenize(),
    "detokenize": schema_of(DetokenizeRequest),
}


def _limits(schema: dict[str, Any]) -> dict[str, Any]:
    """A key's or team's limits as gateway/tenants/tenants.py `_check_limits` checks them."""
    props = schema["properties"]
    for name in ("rpm", "tpm", "budget_tokens"):
        props[name]["minimum"] = 0
    props["burst_s"]["exclusiveMinimum"] = 0
    schema["additionalProperties"] = False
    return schema


def _key() -> dict[str, Any]:
    schema = _limits(schema_of(KeySpec))
    props = schema["properties"]
    props["secret"] = {"anyOf": [{"type": "string", "minLength": 16}, {"type": "null"}], "default": None}
    props["secret_sha256"] = {"anyOf": [{"type": "string", "pattern": "^[0-9a-f]{64}$"}, {"type": "null"}],
                              "default": None}
    # One of them at most (gateway/tenants/tenants.py `key_record`).
    schema["not"] = {"required": ["secret", "secret_sha256"],
                     "properties": {"secret": {"type": "string"}, "secret_sha256": {"type": "string"}}}
    return schema


def _alias() -> dict[str, Any]:
    schema = schema_of(AliasSpec)
    targets = schema["properties"]["targets"]
    target = targets["items"]
    target["properties"]["model"]["minLength"] = 1
    target["properties"]["weight"]["minimum"] = 0
    targets["minItems"] = 1
    # At least one target gets traffic (gateway/models/aliases.py `problems`).
    targets["contains"] = {"anyOf": [{"not": {"required": ["weight"]}},
                                     {"properties": {"weight": {"exclusiveMinimum": 0}}}]}
    return schema


def _fallback() -> dict[str, Any]:
    schema = schema_of(FallbackSpec)
    models = schema["properties"]["models"]
    models["minItems"] = 1
    models["items"]["minLength"] = 1
    return schema


ADMIN_BODIES: dict[str, dict[str, Any]] = {
    "key": _key(),
    "team": _limits(schema_of(TeamSpec)),
    "alias": _alias(),
    "fallback": _fallback(),
    # gateway/api/admin.py `AdapterLoad`: `name` without '/', `path` optional when configured.
    "adapter": {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1, "pattern": "^[^/]+$"},
        "path": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}}},
}
MODEL_LIST = schema_of(ModelList)
MODEL = schema_of(Model)
