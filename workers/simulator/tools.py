"""Forced tool calls, as vLLM answers them: `tool_choice` naming a function, or "required".

vLLM decodes the arguments under the tool's JSON schema (structured output), so the reply
is a `tool_calls` message whose `arguments` are JSON matching the schema, with content ""
and finish_reason "stop" for a named tool ("tool_calls" for "required"), as OpenAI does.
A stream sends the call's id, type and name with the first piece of the arguments, then
`{"index": 0, "function": {"arguments": piece}}` per token (vllm/tool_parsers/streaming.py).
Here the arguments are an example value of the schema drawn from the request's seed; the
sequence generates as many tokens as they have, so timing and usage stay the engine's.
`tool_choice` "auto" (or none) keeps plain text: vLLM needs a tool parser for that.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from typing import Any

from workers.simulator.flavors import SimError

_WORDS = ("paris", "blue", "river", "seven", "north", "delta", "amber", "cedar")


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    # The arguments cut into token-sized pieces: one per generated token.
    pieces: tuple[str, ...]
    named: bool  # else "required": finish_reason "tool_calls"

    def finish(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and not self.named else reason

    def text(self, tokens: int) -> str:
        """The arguments as far as `tokens` generated tokens go (cut short at max_tokens)."""
        return "".join(self.pieces[:tokens])


def _bad(message: str) -> SimError:
    return SimError(400, "bad_request", message, "tool_choice")


def forced_call(body: dict[str, Any], seed: int) -> ToolCall | None:
    """The tool call a chat request forces, or None (no tools, or "auto"/"none")."""
    choice = body.get("tool_choice")
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        tool = next((t for t in tools if t["function"].get("name") == name), None)
        if tool is None:
            raise _bad(f"Tool '{name}' has not been passed in `tools`.")
        named = True
    elif choice == "required":
        if not tools:
            raise _bad('When using `tool_choice`, `tools` must be set.')
        tool, named = tools[0], False
    else:
        return None
    rng = random.Random(seed)
    arguments = json.dumps(example(tool["function"].get("parameters") or {}, rng))
    return ToolCall(id=f"chatcmpl-tool-{uuid.uuid4().hex}", name=tool["function"]["name"],
                    arguments=arguments, pieces=_pieces(arguments), named=named)


def example(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value that the JSON schema accepts (the common keywords: type, enum, const,
    properties/required, items, anyOf/oneOf, defaults)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return example(schema[key][0], rng, depth)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind in ("object", "array"):
        return _container(schema, kind, rng, depth)
    return _scalar(schema, kind, rng)


def _container(schema: dict[str, Any], kind: str, rng: random.Random, depth: int) -> Any:
    if kind == "object":
        props = schema.get("properties") or {}
        if depth > 4:
            return {}
        return {name: example(sub, rng, depth + 1) for name, sub in props.items()}
    return [example(schema.get("items") or {}, rng, depth + 1) for _ in range(max(1, schema.get("minItems", 1)))]


def _scalar(schema: dict[str, Any], kind: str, rng: random.Random) -> Any:
    if kind == "integer":
        return rng.randint(int(schema.get("minimum", 1)), int(schema.get("maximum", 100)))
    if kind == "number":
        return round(rng.uniform(float(schema.get("minimum", 0)), float(schema.get("maximum", 100))), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return rng.choice(_WORDS)


def _pieces(text: str) -> tuple[str, ...]:
    """Token-like pieces of JSON text: about 3 characters each, as a BPE tokenizer cuts it."""
    return tuple(text[i:i + 3] for i in range(0, len(text), 3)) or ("",)


def delta(call: ToolCall, piece: str, first: bool) -> dict[str, Any]:
    """A stream chunk's delta with one piece of the call's arguments (the first names it)."""
    if first:
        entry = {"id": call.id, "type": "function", "index": 0, "function": {"name": call.name, "arguments": piece}}
    else:
        entry = {"index": 0, "function": {"arguments": piece}}
    return {"tool_calls": [entry]}


def message_calls(call: ToolCall, arguments: str) -> list[dict[str, Any]]:
    """The whole message's `tool_calls`."""
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}]


__all__ = ["ToolCall", "delta", "example", "forced_call", "message_calls"]
