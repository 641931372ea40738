"""schemathesis hooks for tests/e2e/test_openapi_contract.py (loaded through SCHEMATHESIS_HOOKS).

They keep generated bodies within what the test's fleet can do, never outside the document:

- JSON Schema 2020-12 reads `2.0` as the integer 2, so schemathesis spells some integers as
  whole floats and expects them taken. The gateway takes them (gateway/wire.py), as vLLM
  does; the simulator behind it refuses `"max_tokens": 2.0` (vLLM's pydantic takes it). Whole
  floats are written as integers, so the test measures the gateway, not that difference.
- A model's limits are not the document's: the fleet's simulated models have 4,096-token
  contexts and no Matryoshka embeddings, so a schema-valid `max_tokens` of 10^9 or a
  `dimensions` is refused (400, as vLLM and OpenAI refuse it). Token counts and `n` are
  kept small (which also keeps each answer quick) and `dimensions` is left out.
- A Responses API answer made with `store: false` or null is not kept (by design), so its OpenAPI
  links to retrieve and cancel lead to a 404: the stateful phase's creations store theirs.
"""

from __future__ import annotations

from typing import Any

import schemathesis

TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
MAX_TOKENS = 32
MAX_CHOICES = 4


def _integral(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


def _within_the_fleet(body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    for name in TOKEN_FIELDS:
        if _count(out.get(name)) and out[name] > MAX_TOKENS:
            out[name] = MAX_TOKENS
    if _count(out.get("n")) and out["n"] > MAX_CHOICES:
        out["n"] = MAX_CHOICES
    if _count(out.get("dimensions")):
        del out["dimensions"]
    return out


def _count(value: Any) -> bool:
    """A valid count (a negative test's invalid one is left as it is)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    body = _integral(body)
    if not isinstance(body, dict):
        return body
    if context.operation is not None and context.operation.path == "/v1/responses" and body.get("store", True) in (False, None):
        # A response made with `store: false` (or null) is not kept, by design: its link to
        # the retrieve and cancel operations would find nothing (a 404 the document states).
        del body["store"]
    return _within_the_fleet(body)
