"""The shapes the gateway decodes off the wire: an OpenAI request's routed fields, an
engine's error answer. msgspec decodes only the fields named here and skips the rest.

They live apart from the code that reads them because that code is compiled with mypyc
(scripts/compile.py), which keeps a class's annotations only as plain types (`list`, not
`list[Message]`): msgspec would then decode less. This module stays Python.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class Part(msgspec.Struct):
    """One content part (`{"type": "text", "text": ...}`, an image, ...): only text counts here."""

    text: str | None = None


class Message(msgspec.Struct):
    """A chat message, or an item of a Responses API `input` (a message, a tool call's output)."""

    role: str = ""
    # A string, or a list of content parts.
    content: str | list[Part] | None = None
    # A tool call's output (Responses API `function_call_output` items).
    output: str | None = None
    # Only whether they are there: a chat template renders them (gateway/request/prefix_cache.py).
    tool_calls: msgspec.Raw = msgspec.Raw()
    name: msgspec.Raw = msgspec.Raw()


class StreamOptions(msgspec.Struct):
    # Kept loose: the engine judges the value; only `true` asks for the usage chunk.
    include_usage: object = None


class Probe(msgspec.Struct):
    """The fields of an OpenAI request that routing reads."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Integers; `2.0` is the integer 2 (as JSON Schema and vLLM read it): `__post_init__`.
    max_tokens: int | float | None = None
    max_completion_tokens: int | float | None = None
    user: str | None = None
    messages: list[Message] | None = None
    # A string, a list of strings, token ids or lists of them: kept raw (msgspec cannot
    # decode that union), decoded by `prompt_texts` only when a completion needs it.
    prompt: msgspec.Raw = msgspec.Raw()
    # The Responses API: `input` is a string or a list of items, `instructions` play the
    # system prompt, and a follow-up names the response it continues.
    input: str | list[Message] | None = None
    instructions: str | None = None
    max_output_tokens: int | float | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    # What else shapes the prompt a chat template renders (vLLM's chat parameters): kept
    # raw, only to know whether the gateway can render the prompt as the engine will.
    tools: msgspec.Raw = msgspec.Raw()
    chat_template: msgspec.Raw = msgspec.Raw()
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    add_generation_prompt: msgspec.Raw = msgspec.Raw()
    continue_final_message: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()

    def __post_init__(self) -> None:
        if float in (type(self.max_tokens), type(self.max_completion_tokens), type(self.max_output_tokens)):
            self.max_tokens = _whole(self.max_tokens, "max_tokens")
            self.max_completion_tokens = _whole(self.max_completion_tokens, "max_completion_tokens")
            self.max_output_tokens = _whole(self.max_output_tokens, "max_output_tokens")

    @property
    def max_new_tokens(self) -> int | None:
        value = self.max_completion_tokens or self.max_tokens or self.max_output_tokens
        return None if value is None else int(value)

    @property
    def wants_usage(self) -> bool:
        """Whether a stream's client asked for the final usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage is True


def _whole(value: int | float | None, name: str) -> int | None:
    """`value` as an int; a fraction is refused (msgspec reports it as a ValidationError)."""
    if not isinstance(value, float):
        return value
    if not value.is_integer():
        raise ValueError(f"Expected `int`, got a number with a fractional part - at `$.{name}`")
    return int(value)


class Embeddings(msgspec.Struct):
    """An embeddings request: its `input` takes the forms a completion's `prompt` does."""

    model: str
    input: msgspec.Raw = msgspec.Raw()
    user: str | None = None
    # vLLM's `bytes` and `bytes_only` answer raw vectors with a `metadata` header, which the
    # gateway's whole-answer relay (JSON) would mislabel and drop: refused with a clear 400.
    encoding_format: Literal["float", "base64"] = "float"


# An engine's error answer: OpenAI's nested shape, or LMDeploy's, ms-swift's and FastAPI's flat ones.
class NestedError(msgspec.Struct):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: int | str | None = None


class EngineError(msgspec.Struct):
    error: NestedError | str | None = None
    detail: str | list[object] | None = None
    message: str | None = None
    type: str | None = None
    param: str | None = None
    code: int | str | None = None


# The usage an OpenAI answer or SSE event carries (gateway/observe/metrics.py, `usage_of`).
class Usage(msgspec.Struct):
    prompt_tokens: int | None = 0
    completion_tokens: int | None = 0
    # The Responses API's names for the same counts.
    input_tokens: int | None = 0
    output_tokens: int | None = 0


class UsageResponse(msgspec.Struct):
    usage: Usage | None = None


class WithUsage(msgspec.Struct):
    usage: Usage | None = None
    # A Responses API stream's last event carries the whole response, usage inside.
    response: UsageResponse | None = None


# A streamed chunk as gateway/request/resume.py decodes it (only when a stream must be resumed).
class StreamDelta(msgspec.Struct):
    content: str | None = None
    role: str | None = None
    tool_calls: list[msgspec.Raw] | None = None


class StreamChoice(msgspec.Struct):
    index: int = 0
    delta: StreamDelta | None = None
    text: str | None = None
    finish_reason: str | None = None


class StreamChunk(msgspec.Struct):
    id: str = ""
    created: int = 0
    choices: list[StreamChoice] = msgspec.field(default_factory=list)
    usage: dict[str, Any] | None = None
