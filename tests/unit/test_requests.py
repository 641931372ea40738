"""What the gateway reads of a request (gateway/request/requests.py): every OpenAI request shape the
engines accept is understood, and every malformed one is a 400 naming its field."""

from __future__ import annotations

import json

import pytest

from gateway.errors import InvalidRequest
from gateway.request.requests import affinity, estimate_tokens, parse_request


def _probe(kind: str, **body: object):  # type: ignore[no-untyped-def]
    return parse_request(json.dumps({"model": "m", **body}).encode(), kind)


@pytest.mark.parametrize(
    ("kind", "body", "estimate", "floor"),
    [
        # 20 bytes of text: ~4 bytes a token, plus the template's tokens per message.
        ("chat", {"messages": [{"role": "user", "content": "x" * 20}]}, 5 + 4, 2),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 12},
                                                             {"type": "image_url", "image_url": {"url": "u"}},
                                                             {"type": "text", "text": "x" * 8}]}]}, 5 + 4, 2),
        ("completion", {"prompt": "x" * 40}, 10, 5),
        # Separate prompts must each fit: the longest counts.
        ("completion", {"prompt": ["x" * 16, "x" * 40]}, 10, 5),
        # Token ids count exactly.
        ("completion", {"prompt": [5, 6, 7]}, 3, 3),
        ("completion", {"prompt": [[5, 6], [7]]}, 2, 2),
        ("embeddings", {"input": ["x" * 8, "x" * 20]}, 5, 2),
        ("embeddings", {"input": [[1, 2, 3, 4]]}, 4, 4),
        ("responses", {"input": "x" * 20}, 5, 2),
        ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "x" * 20}]}],
                       "instructions": "y" * 20}, 10 + 8, 5),
        ("responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": "x" * 8}]}, 2 + 4, 1),
    ],
)
def test_prompt_size_is_estimated_in_every_shape(kind: str, body: dict[str, object], estimate: int, floor: int) -> None:
    assert estimate_tokens(_probe(kind, **body)) == (estimate, floor)


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("chat", {}, "messages"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages"),
        ("completion", {}, "prompt"),
        ("completion", {"prompt": None}, "prompt"),
        ("responses", {}, "input"),
        ("responses", {"input": 5}, "input"),
        ("responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ("responses", {"input": "hi", "previous_response_id": ""}, "previous_response_id"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, "max_completion_tokens"),
        ("completion", {"prompt": "hi", "max_tokens": 1, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_malformed_requests_name_their_field(kind: str, body: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        _probe(kind, **body)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("kind", "body", "session", "affinity_kind", "same_as"),
    [
        # Instructions play the system prompt: requests sharing them meet, whatever their input.
        ("responses", {"input": "a", "instructions": "sys"}, None, "prefix",
         ("responses", {"input": "b", "instructions": "sys"})),
        ("chat", {"messages": [{"role": "system", "content": [{"type": "text", "text": "sys"}]},
                               {"role": "user", "content": "a"}]}, None, "prefix",
         ("chat", {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "b"}]})),
        ("completion", {"prompt": [1, 2, 3]}, None, "prefix", ("completion", {"prompt": [1, 2, 3]})),
        ("responses", {"input": "a"}, "s1", "session", ("responses", {"input": "b"})),
    ],
)
def test_affinity_keys(kind: str, body: dict[str, object], session: str | None, affinity_kind: str,
                       same_as: tuple[str, dict[str, object]]) -> None:
    key, got_kind = affinity(_probe(kind, **body), session)
    assert got_kind == affinity_kind
    other, _ = affinity(_probe(same_as[0], **same_as[1]), session)
    assert key == other
