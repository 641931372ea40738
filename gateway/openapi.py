"""OpenAPI descriptions of the OpenAI routes.

The handlers read raw bytes (the body is forwarded untouched, never re-encoded), so
Litestar cannot infer their schemas. These Structs describe what the gateway accepts
and answers, for the docs, the generated clients and the schema fuzzing in CI. They
describe; they do not validate on the request path (gateway/requests.py does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from litestar.openapi.spec import Operation, RequestBody
from litestar.openapi.spec.media_type import OpenAPIMediaType
from litestar.openapi.spec.response import OpenAPIResponse

_REF = "#/components/schemas/{name}"


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields both endpoints share (engines accept more; those pass through untouched)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str]


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The Responses API (vLLM's subset of OpenAI's: text in, text out)."""

    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = None
    # Continue a stored response: the request goes to the worker that stores it.
    previous_response_id: str | None = None
    store: bool | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    model: str
    # A string, strings, token ids, or lists of token ids (msgspec's schema cannot say
    # "one of several kinds of list").
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str
    tokens: list[int]


class ErrorDetail(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | int | None


class Error(msgspec.Struct):
    error: ErrorDetail


class Model(msgspec.Struct):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    parent: str | None


class ModelList(msgspec.Struct):
    object: Literal["list"]
    data: list[Model]


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """The schema with every $ref replaced by its definition (these types are not recursive)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            return _inline(defs[ref.rsplit("/", 1)[1]], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


_schemas, _defs = msgspec.json.schema_components(
    [ChatCompletionRequest, CompletionRequest, ResponsesRequest, EmbeddingsRequest, TokenizeRequest,
     DetokenizeRequest, Error, ModelList],
    ref_template=_REF,
)
_CHAT, _COMPLETION, _RESPONSES, _EMBEDDINGS, _TOKENIZE, _DETOKENIZE, _ERROR, _MODELS = (
    _inline(x, _defs) for x in _schemas
)

_ERRORS = {
    str(status): OpenAPIResponse(description=why, content={"application/json": OpenAPIMediaType(schema=_ERROR)})  # type: ignore[arg-type]
    for status, why in [
        (400, "Malformed JSON or body, or a prompt over the context length"),
        (401, "Missing or invalid API key"),
        (404, "No worker serves this model or adapter, or the named stored response is unknown"),
        (413, "Body over the size limit"),
        (429, "Every worker is full, or this client is over its rate limit (Retry-After)"),
        (502, "The engines failed"),
        (503, "No worker can serve the model right now (Retry-After)"),
        (504, "The engines did not answer in time"),
    ]
}


def _body(schema: dict[str, Any]) -> RequestBody:
    return RequestBody(content={"application/json": OpenAPIMediaType(schema=schema)}, required=True)  # type: ignore[arg-type]


_STREAM_OR_JSON = OpenAPIResponse(
    description="The engine's answer: JSON, or Server-Sent Events when `stream` is true",
    content={"application/json": OpenAPIMediaType(schema={"type": "object"}),  # type: ignore[arg-type]
             "text/event-stream": OpenAPIMediaType(schema={"type": "string"})},  # type: ignore[arg-type]
)


_JSON_ANSWER = OpenAPIResponse(
    description="The engine's answer",
    content={"application/json": OpenAPIMediaType(schema={"type": "object"})},  # type: ignore[arg-type]
)

# Per proxied route (its kind, as in gateway/requests.py KINDS): the body it takes, what it
# answers, the operation's id (OpenAI's names) and summary.
_PROXIED: dict[str, tuple[dict[str, Any], OpenAPIResponse, str, str]] = {
    "chat": (_CHAT, _STREAM_OR_JSON, "createChatCompletion", "Chat completion, whole or streamed"),
    "completion": (_COMPLETION, _STREAM_OR_JSON, "createCompletion", "Text completion, whole or streamed"),
    "responses": (_RESPONSES, _STREAM_OR_JSON, "createResponse", "Responses API, whole or streamed"),
    "embeddings": (_EMBEDDINGS, _JSON_ANSWER, "createEmbedding", "Embeddings from an embedding model"),
    "tokenize": (_TOKENIZE, _JSON_ANSWER, "tokenize", "vLLM's tokenizer: text or messages to token ids"),
    "detokenize": (_DETOKENIZE, _JSON_ANSWER, "detokenize", "vLLM's tokenizer: token ids to text"),
}


def proxied_operation(kind: str) -> tuple[type[Operation], str]:
    """(the Operation class, the operation id) describing one proxied route."""
    schema, answer, operation_id, summary = _PROXIED[kind]

    @dataclass
    class ProxiedOperation(Operation):
        def __post_init__(self) -> None:
            self.summary = summary
            self.request_body = _body(schema)
            self.responses = {"200": answer, **_ERRORS}

    return ProxiedOperation, operation_id


@dataclass
class StoredResponseOperation(Operation):
    """Retrieve or cancel a stored response (answered by the worker that stores it)."""

    def __post_init__(self) -> None:
        self.responses = {
            "200": _JSON_ANSWER,
            **{k: _ERRORS[k] for k in ("401", "404", "502", "503", "504")},
        }


@dataclass
class ModelsOperation(Operation):
    def __post_init__(self) -> None:
        self.responses = {
            "200": OpenAPIResponse(description="Models and adapters the ready fleet serves",
                                   content={"application/json": OpenAPIMediaType(schema=_MODELS)}),  # type: ignore[arg-type]
            "401": _ERRORS["401"],
        }
