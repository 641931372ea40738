"""The OpenAPI document's building blocks (gateway/api/openapi.py, gateway/api/options.py) and the
wire fixes the contract test led to (whole floats, engines' errors, embeddings encodings)."""

from __future__ import annotations

import msgspec
import pytest
from litestar import Litestar, Response, delete, put
from litestar.testing import TestClient

from gateway.api.openapi import ANY, WITH_BODY, documented
from gateway.api.options import with_options
from gateway.engines.upstream import openai_error_body
from gateway.errors import InvalidRequest
from gateway.request.requests import parse_request


@put("/things/{name:str}", **documented(400, body={"type": "object"}))
async def put_thing() -> Response[bytes]:
    return Response(b"{}", media_type="application/json")


@delete("/things/{name:str}", status_code=200, **documented(404))
async def delete_thing() -> Response[bytes]:
    return Response(b"{}", media_type="application/json")


def test_every_error_status_has_the_error_object_and_nothing_else_is_kept() -> None:
    """An operation lists its own errors, those any request can get, and a body's; each one
    refers to the shared error schema; Litestar's own 400 schema is gone."""
    app = Litestar([put_thing, delete_thing])
    paths = app.openapi_schema.to_schema()["paths"]["/things/{name}"]
    put_statuses = set(paths["put"]["responses"])
    assert put_statuses == {"200", *map(str, (400, *ANY, *WITH_BODY))}
    assert set(paths["delete"]["responses"]) == {"200", "404", *map(str, ANY)}
    for status in put_statuses - {"200"}:
        schema = paths["put"]["responses"][status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorEnvelope"}
    assert paths["put"]["requestBody"]["required"] is True


def test_options_lists_every_method_of_a_shared_path() -> None:
    """Litestar 2 answered `Allow: OPTIONS, PUT` here; the explicit handler names DELETE too,
    and a 405 says the same."""
    with TestClient(Litestar(with_options([put_thing, delete_thing]))) as client:
        reply = client.options("/things/x")
        assert reply.status_code == 204 and reply.headers["allow"] == "DELETE, OPTIONS, PUT"
        refused = client.post("/things/x")
        assert refused.status_code == 405
        assert set(refused.headers["allow"].replace(" ", "").split(",")) == {"DELETE", "OPTIONS", "PUT"}


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_whole_float_is_an_integer_and_a_fraction_is_refused(field: str) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_request(msgspec.json.encode({**body, field: 5.0}), "chat").max_new_tokens == 5
    with pytest.raises(InvalidRequest) as refused:
        parse_request(msgspec.json.encode({**body, field: 5.5}), "chat")
    assert refused.value.param == field


def test_raw_vector_encodings_are_refused_with_a_400() -> None:
    """vLLM's `bytes` answers raw vectors the gateway would relay as JSON: refused, not mangled."""
    for encoding in ("bytes", "bytes_only", None):
        body = msgspec.json.encode({"model": "e", "input": "x", "encoding_format": encoding})
        with pytest.raises(InvalidRequest) as refused:
            parse_request(body, "embeddings")
        assert refused.value.param == "encoding_format"
    assert parse_request(b'{"model": "e", "input": "x", "encoding_format": "base64"}', "embeddings").model == "e"


def test_engine_errors_always_carry_the_four_fields() -> None:
    """vLLM's complete nested errors pass as they are; one missing a field is completed."""
    whole = b'{"error":{"message":"m","type":"BadRequestError","param":null,"code":400}}'
    assert openai_error_body(400, whole) == whole
    completed = msgspec.json.decode(openai_error_body(404, b'{"error":{"message":"gone"}}'))["error"]
    assert completed == {"message": "gone", "type": "invalid_request_error", "param": None, "code": 404}
