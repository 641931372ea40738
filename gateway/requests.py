"""What routing needs to know about an OpenAI request, read without re-encoding the body.

msgspec decodes only the fields named here and skips the rest; the body itself is
forwarded byte for byte. From those fields come the request's facts: the model,
how many tokens the prompt has (exactly with the model's tokenizer when one is
configured, else estimated), and the affinity key that keeps requests sharing a
prefix or a session on one worker.
"""

from __future__ import annotations

import math

import msgspec

from fleetgate.hashing import stable_hash
from gateway.errors import InvalidRequest

# Characters of the shared prefix that make an affinity key. Long enough to tell
# system prompts apart, short enough to hash in microseconds.
PREFIX_CHARS = 2048
# Tokens a chat template adds around each message (role markers, separators).
TEMPLATE_TOKENS_PER_MESSAGE = 4


class Message(msgspec.Struct):
    role: str = ""
    # A string, or a list of content parts (kept raw: only their size matters here).
    content: str | msgspec.Raw | None = None


class Probe(msgspec.Struct):
    """The fields of an OpenAI request that routing reads."""

    model: str
    stream: bool = False
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    user: str | None = None
    messages: list[Message] | None = None
    prompt: str | list[str] | msgspec.Raw | None = None


_probe = msgspec.json.Decoder(Probe)


def parse_request(body: bytes, kind: str) -> Probe:
    """Decode and check the routing fields; every problem is an OpenAI-style 400."""
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    try:
        probe = _probe.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request body: {exc}", param=_field_of(exc)) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc
    if not probe.model:
        raise InvalidRequest("`model` must name a model or adapter.", param="model")
    if kind == "chat" and not probe.messages:
        raise InvalidRequest("`messages` must be a non-empty array.", param="messages")
    if kind == "completion" and probe.prompt is None:
        raise InvalidRequest("`prompt` is required.", param="prompt")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(probe, name)
        if value is not None and value < 1:
            raise InvalidRequest(f"`{name}` must be at least 1.", param=name)
    return probe


def _field_of(exc: msgspec.ValidationError) -> str | None:
    # msgspec says "... - at `$.field`" or "Object missing required field `field`"
    text = str(exc)
    if "`$." in text:
        return text.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0]
    if "required field `" in text:
        return text.split("required field `", 1)[1].split("`", 1)[0]
    return None


def _text(content: str | msgspec.Raw | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return bytes(content).decode(errors="replace")


def prompt_texts(probe: Probe) -> list[str]:
    if probe.messages is not None:
        return [_text(m.content) for m in probe.messages]
    prompt = probe.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list):
        return prompt
    return [bytes(prompt).decode(errors="replace")] if prompt is not None else []


def estimate_tokens(probe: Probe) -> tuple[int, int]:
    """(estimate, lower bound) of the prompt's tokens without a tokenizer.

    BPE tokenizers average about 4 bytes a token on prose and code; nothing real
    packs more than about 8 bytes into a token, so bytes/8 is a floor.
    """
    size = sum(len(t.encode()) for t in prompt_texts(probe))
    overhead = TEMPLATE_TOKENS_PER_MESSAGE * len(probe.messages or ())
    return math.ceil(size / 4) + overhead, size // 8


def affinity(probe: Probe, session: str | None, adapter: bool = False) -> tuple[int | None, str | None]:
    """The key requests share: an adapter, else a system prompt, a session, the prompt's head.

    Requests for one LoRA adapter meet on one worker (bounded by load) so it stays in
    that engine's adapter slots instead of being swapped in everywhere; its prefix
    cache is separate per adapter anyway. A shared system prompt is the largest
    prefix many requests have in common, so it beats the session; a session without
    one keeps a conversation (whose history is its prefix) on one worker.
    """
    model = probe.model
    if adapter:
        return stable_hash(f"adapter\0{model}"), "adapter"
    messages = probe.messages
    if messages:
        first = messages[0]
        if first.role in ("system", "developer") and first.content:
            return stable_hash(f"{model}\0{_text(first.content)[:PREFIX_CHARS]}"), "prefix"
        if session:
            return stable_hash(f"{model}\0session\0{session}"), "session"
        return stable_hash(f"{model}\0{_text(first.content)[:PREFIX_CHARS]}"), "prefix"
    if session:
        return stable_hash(f"{model}\0session\0{session}"), "session"
    texts = prompt_texts(probe)
    if texts and texts[0]:
        return stable_hash(f"{model}\0{texts[0][:PREFIX_CHARS]}"), "prefix"
    return None, None


class TokenCounter:
    """Exact prompt token counts with a base model's own tokenizer (a tokenizer.json)."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(path)

    def count(self, probe: Probe) -> int:
        texts = [t for t in prompt_texts(probe) if t]
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
        overhead = TEMPLATE_TOKENS_PER_MESSAGE * len(probe.messages or ())
        return sum(len(e.ids) for e in encoded) + overhead
