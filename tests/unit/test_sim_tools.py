"""The simulator's forced tool calls (workers/simulator/tools.py): arguments that match the
tool's schema, vLLM's errors, and the pieces a stream sends."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from workers.simulator.flavors import SimError
from workers.simulator.tools import delta, example, forced_call

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
                   "unit": {"enum": ["c", "f"]}, "hourly": {"type": "boolean"},
                   "tags": {"type": "array", "items": {"type": "string"}},
                   "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
                   "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}}}


@pytest.mark.parametrize(
    ("schema", "check"),
    [
        ({"type": "string"}, lambda v: isinstance(v, str)),
        ({"type": "integer", "minimum": 3, "maximum": 4}, lambda v: v in (3, 4)),
        ({"type": "number"}, lambda v: isinstance(v, float)),
        ({"type": "boolean"}, lambda v: isinstance(v, bool)),
        ({"enum": ["a", "b"]}, lambda v: v in ("a", "b")),
        ({"const": 5}, lambda v: v == 5),
        ({"type": ["null", "integer"]}, lambda v: isinstance(v, int)),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, lambda v: len(v) == 2),
    ],
)
def test_example_values_match_their_schema(schema: dict[str, Any], check: Any) -> None:
    assert check(example(schema, random.Random(1)))


def test_a_named_tool_gets_json_arguments_for_its_schema() -> None:
    """Every property gets a value of its type; the pieces join into the arguments."""
    call = forced_call({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, 7)
    assert call is not None and call.named and call.name == "get_weather"
    args = json.loads(call.arguments)
    assert isinstance(args["city"], str) and 1 <= args["days"] <= 7 and args["unit"] in ("c", "f")
    assert isinstance(args["where"]["lat"], float) and isinstance(args["tags"][0], str)
    assert "".join(call.pieces) == call.arguments and call.finish("stop") == "stop"


def test_required_picks_a_tool_and_finishes_with_tool_calls() -> None:
    call = forced_call({"tools": [WEATHER], "tool_choice": "required"}, 1)
    assert call is not None and not call.named and call.finish("stop") == "tool_calls"
    assert call.finish("length") == "length"  # cut short by max_tokens


@pytest.mark.parametrize("choice", [None, "auto", "none"])
def test_no_forced_call_without_a_forcing_choice(choice: str | None) -> None:
    assert forced_call({"tools": [WEATHER], "tool_choice": choice}, 1) is None


def test_vllms_errors_for_a_tool_not_given() -> None:
    with pytest.raises(SimError, match="has not been passed"):
        forced_call({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}}, 1)
    with pytest.raises(SimError, match="`tools` must be set"):
        forced_call({"tool_choice": "required"}, 1)


def test_stream_deltas_name_the_call_once() -> None:
    call = forced_call({"tools": [WEATHER], "tool_choice": "required"}, 1)
    assert call is not None
    first, later = delta(call, "{", True), delta(call, "\"c", False)
    assert first["tool_calls"][0] == {"id": call.id, "type": "function", "index": 0,
                                      "function": {"name": "get_weather", "arguments": "{"}}
    assert later["tool_calls"][0] == {"index": 0, "function": {"arguments": "\"c"}}
