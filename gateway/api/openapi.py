"""The OpenAPI document: what every operation takes and every status it can answer.

The document is the wire. Every error status of every operation is documented with the
one error object the gateway sends (OpenAI's `{"error": {"message", "type", "param",
"code"}}`, `gateway.errors.ErrorEnvelope`, one shared component); every status an
operation can answer is listed; the constraints the gateway and its engines enforce
(`model` non-empty, numeric ranges, enums) are stated, so a request valid by the document
is not refused for its shape. schemathesis checks all of it in the suite
(tests/e2e/test_openapi_contract.py).

Handlers read raw bytes (the body is forwarded untouched, never re-encoded), so Litestar
cannot infer request bodies: the Structs of gateway/api/openapi_bodies.py describe them. They
describe; they do not validate on the request path (gateway/request/requests.py does that).

`documented(...)` gives a route decorator's OpenAPI arguments: the error responses as
Litestar `ResponseSpec`s (which puts the error object in `components/schemas` once), and
an `Operation` class that sets the request body, the success responses and links, and
drops any response Litestar inferred that the route cannot answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    Components,
    Link,
    Operation,
    Parameter,
    RequestBody,
    SecurityScheme,
)
from litestar.openapi.spec.header import OpenAPIHeader
from litestar.openapi.spec.media_type import OpenAPIMediaType
from litestar.openapi.spec.response import OpenAPIResponse

from gateway.api.openapi_bodies import PROXIED_BODIES
from gateway.errors import ErrorEnvelope
from gateway.tenants.tenants import ID_RE

# Why each status happens, as the document says it (an operation may say more precisely).
WHY: dict[int, str] = {
    400: "The body or a parameter is invalid (the OpenAI error object names it in `param`)",
    401: "Missing or invalid credentials",
    403: "The API key may not use this model",
    404: "Not found",
    408: "The request body arrived too slowly (the gateway's body timeout)",
    409: "The request conflicts with the current state of what it names",
    413: "The request body is over the gateway's size limit",
    414: "The request target is over the gateway's request-line limit",
    422: "The engine refused the body's fields (engines built on FastAPI answer 422)",
    429: "Every worker is full, or the client is over its rate limit or token budget (Retry-After)",
    431: "The request's headers are over the gateway's header limits",
    500: "Internal error in the gateway (the error object, never a traceback)",
    502: "The engine failed",
    503: "No worker can serve right now, the gateway cannot reach its registry (Redis), or it "
         "holds as many connections as it may (Retry-After)",
    504: "The engine did not answer in time",
}

# What any request can get before it reaches its route: the front connection's limits
# (gateway/front/front_limits.py), the connection limit, and the gateway's own failure.
ANY = (414, 431, 500, 503)
# What any request with a body can get as well.
WITH_BODY = (408, 413)

# When to try again, in seconds: on every 429, and on a 503 the gateway expects to pass.
RETRY_AFTER = {"Retry-After": OpenAPIHeader(
    schema={"type": "string", "pattern": "^[0-9]+$"},  # type: ignore[arg-type]
    description="Seconds to wait before trying again", required=False)}

API_KEY = "apiKey"
ADMIN_TOKEN = "adminToken"
COMPONENTS = Components(security_schemes={
    API_KEY: SecurityScheme(
        type="http", scheme="bearer",
        description="An API key (FLEETGATE_API_KEYS, or a key of `PUT /admin/keys/{key_id}`): "
                    "`Authorization: Bearer <key>`. A gateway with no API keys at all takes "
                    "requests without one (for a fleet behind a proxy that authenticates)."),
    ADMIN_TOKEN: SecurityScheme(
        type="http", scheme="bearer",
        description="The admin token (FLEETGATE_ADMIN_TOKEN): `Authorization: Bearer <token>`."),
})
CLIENT_SECURITY: list[dict[str, list[str]]] = [{API_KEY: []}]
ADMIN_SECURITY: list[dict[str, list[str]]] = [{ADMIN_TOKEN: []}]


def _json(schema: Mapping[str, Any]) -> dict[str, OpenAPIMediaType]:
    return {"application/json": OpenAPIMediaType(schema=dict(schema))}  # type: ignore[arg-type]


JSON_OBJECT = {"type": "object"}
# One Server-Sent Event: `data` is a JSON chunk (or `[DONE]` at the end of a chat or
# completion stream); a Responses stream names each event's type in `event`.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
STREAM_OR_JSON = OpenAPIResponse(
    description="The engine's answer: JSON, or Server-Sent Events when `stream` is true",
    content={**_json(JSON_OBJECT), "text/event-stream": OpenAPIMediaType(schema=SSE_EVENT)},  # type: ignore[arg-type]
)
JSON_ANSWER = OpenAPIResponse(description="The engine's answer", content=_json(JSON_OBJECT))


def json_answer(description: str, schema: Mapping[str, Any] = JSON_OBJECT) -> OpenAPIResponse:
    return OpenAPIResponse(description=description, content=_json(schema))


def documented(
    *errors: int,
    why: Mapping[int, str] | None = None,
    ok: Mapping[int, OpenAPIResponse] | None = None,
    body: Mapping[str, Any] | None = None,
    summary: str | None = None,
    links: Mapping[str, Link] | None = None,
    params: Mapping[str, tuple[str, Mapping[str, Any], str]] | None = None,
    body_required: bool = True,
) -> dict[str, Any]:
    """A route decorator's OpenAPI arguments for an operation that answers `ok` (default:
    Litestar's own 200) and the error statuses `errors` (plus those any request can get,
    and those of a body when it takes one). `params`: name -> (where, schema, description) of
    the parameters the handler reads itself (a query's), or whose schema is narrower than
    its type (a path's pattern)."""
    statuses = sorted({*errors, *ANY, *(WITH_BODY if body is not None else ())})
    said = {**WHY, **(why or {})}
    responses = {s: ResponseSpec(data_container=ErrorEnvelope, description=said[s], generate_examples=False)
                 for s in statuses}
    successes = dict(ok or {})
    keep = {str(s) for s in (*statuses, *(successes or (200,)))}
    request_body = (RequestBody(content=_json(body), required=body_required) if body is not None else None)

    @dataclass
    class Documented(Operation):
        def __post_init__(self) -> None:
            inferred = {k: _retry_after(v) if k in ("429", "503") else v
                        for k, v in (self.responses or {}).items() if k in keep}
            answers = {**inferred, **{str(s): r for s, r in successes.items()}}
            if links:
                first = min(k for k in answers if k.startswith("2"))
                if isinstance(answer := answers[first], OpenAPIResponse):
                    answers[first] = _with_links(answer, links)
            self.responses = dict(sorted(answers.items()))
            if request_body is not None:
                self.request_body = request_body
            if summary:
                self.summary = summary
            if params:
                given = {p.name: p for p in self.parameters or [] if isinstance(p, Parameter)}
                for name, (where, schema, about) in params.items():
                    given[name] = Parameter(name=name, param_in=where, schema=dict(schema),  # type: ignore[arg-type]
                                            required=where == "path", description=about)
                self.parameters = list(given.values())  # type: ignore[assignment]

    return {"responses": responses, "operation_class": Documented}


def _retry_after(response: OpenAPIResponse | Any) -> OpenAPIResponse | Any:
    if not isinstance(response, OpenAPIResponse):
        return response
    return OpenAPIResponse(description=response.description, content=response.content,
                           headers=dict(RETRY_AFTER))  # type: ignore[arg-type]


def _with_links(response: OpenAPIResponse, links: Mapping[str, Link]) -> OpenAPIResponse:
    return OpenAPIResponse(description=response.description, headers=response.headers,
                           content=response.content, links=dict(links))  # type: ignore[arg-type]


# -- the OpenAI routes ------------------------------------------------------------------

# What a proxied route can answer besides 200: the gateway's refusals, and an engine's
# 4xx relayed as the engine gave it (in the error object).
PROXIED_ERRORS = (400, 401, 403, 404, 422, 429, 502, 503, 504)
PROXIED_WHY = {
    400: "Malformed JSON or body, a field the engine refuses, or a prompt over the model's context length",
    404: "No worker serves this model or adapter, or `previous_response_id` names no stored response",
}

# Per proxied route kind (gateway/request/requests.py KINDS): the operation's id (OpenAI's names),
# its summary, and whether it can stream.
_PROXIED: dict[str, tuple[str, str, bool]] = {
    "chat": ("createChatCompletion", "Chat completion, whole or streamed", True),
    "completion": ("createCompletion", "Text completion, whole or streamed", True),
    "responses": ("createResponse", "Responses API, whole or streamed", True),
    "embeddings": ("createEmbedding", "Embeddings from an embedding model", False),
    "tokenize": ("tokenize", "vLLM's tokenizer: text or messages to token ids", False),
    "detokenize": ("detokenize", "vLLM's tokenizer: token ids to text", False),
}

# A stored response's id, from the answer that created it, for its retrieve and cancel.
RESPONSE_LINKS = {
    "GetResponse": Link(operation_id="getResponse", parameters={"response_id": "$response.body#/id"}),
    "CancelResponse": Link(operation_id="cancelResponse", parameters={"response_id": "$response.body#/id"}),
}


def proxied(kind: str) -> dict[str, Any]:
    """The route decorator's arguments for one proxied OpenAI POST route."""
    operation_id, summary, streams = _PROXIED[kind]
    return {
        "operation_id": operation_id, "security": CLIENT_SECURITY,
        **documented(*PROXIED_ERRORS, why=PROXIED_WHY, body=PROXIED_BODIES[kind], summary=summary,
                     ok={200: STREAM_OR_JSON if streams else JSON_ANSWER},
                     links=RESPONSE_LINKS if kind == "responses" else None),
    }


def stored(operation_id: str, summary: str, *errors: int) -> dict[str, Any]:
    """A retrieve or cancel of a stored response, answered by the worker that stores it."""
    return {
        "operation_id": operation_id, "security": CLIENT_SECURITY,
        **documented(400, 401, 404, 422, 502, 503, 504, *errors, summary=summary, ok={200: JSON_ANSWER}, why={
            400: "The engine refused the request",
            404: "No stored response has this id (created with `store: false`, expired, or its worker left)",
            409: "The response is not running (only a background response can be cancelled)"}),
    }


# -- the admin API ------------------------------------------------------------------------


def admin(*errors: int, **kw: Any) -> dict[str, Any]:
    """An admin operation: behind the admin token (401), and `errors` besides."""
    return documented(401, *errors, **kw)


PUT_ANSWERS = {200: json_answer("Replaced"), 201: json_answer("Created")}
# A key's or team's id (gateway/tenants/tenants.py ID_RE).
TENANT_ID = {"type": "string", "pattern": ID_RE.pattern}
# An alias's or a fallback chain's model name (gateway/api/routes.py `_name`): leading
# slashes are dropped, then 1-256 characters without whitespace (Python's, which also
# counts U+001C-U+001F: said outright, as other regex engines do not).
ROUTE_NAME_RE = r"^/*[^/\s\x1c-\x1f][^\s\x1c-\x1f]{0,255}$"
ROUTE_NAME = {"type": "string", "pattern": ROUTE_NAME_RE}
# A yes/no query parameter, in any case (`?stop=True` from a client that writes it so).
FLAG_RE = "^([Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee]|1|0)$"
FLAG = {"type": "string", "pattern": FLAG_RE}
DAY_RE = "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"
