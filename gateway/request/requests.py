"""What routing needs to know about an OpenAI request, read without re-encoding the body.

msgspec decodes only the fields named in gateway/wire.py and skips the rest; the body itself is
forwarded byte for byte. From those fields come the request's facts: the model,
how many tokens the prompt has (exactly with the model's tokenizer when one is
configured, else estimated), and the affinity key that keeps requests sharing a
prefix or a session on one worker.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from fleetgate.hashing import stable_hash
from gateway.errors import InvalidRequest
from gateway.wire import Embeddings, Part, Probe

# Characters of the shared prefix that make an affinity key. Long enough to tell
# system prompts apart, short enough to hash in microseconds.
PREFIX_CHARS = 2048
# Tokens a chat template adds around each message (role markers, separators).
TEMPLATE_TOKENS_PER_MESSAGE = 4
# A message text this long has its token count kept (a system prompt, a document, an earlier
# turn: sent again and again), up to CACHED_CHARS characters of texts per tokenizer (~2 bytes
# a character in memory, so ~16 MB), least recently used out first.
CACHED_TEXT_CHARS = 256
CACHED_CHARS = 1 << 23


_probe = msgspec.json.Decoder(Probe)
_embeddings = msgspec.json.Decoder(Embeddings)

# The OpenAI (and vLLM) POST routes the gateway routes by `model`, and what each is.
KINDS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/embeddings": "embeddings",
    "/tokenize": "tokenize",
    "/detokenize": "detokenize",
}
# Kinds that generate text: they have a prompt worth keeping where its prefix is cached.
GENERATES = frozenset({"chat", "completion", "responses"})


def headers_by_name(headers: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """A request's headers by (lower-case) name; the first of a repeated one wins."""
    return dict(reversed(headers))  # a dict keeps the last it is given


def header_reader(names: dict[bytes, bytes]) -> Callable[[str], str | None]:
    """`header(name)`, as `Proxy.serve` reads a request header, over `headers_by_name`'s dict."""
    def header(name: str) -> str | None:
        value = names.get(name.encode())
        return None if value is None else value.decode("latin-1")

    return header


def parse_request(body: bytes, kind: str) -> Probe:
    """Decode and check the routing fields; every problem is an OpenAI-style 400."""
    if not body:
        raise InvalidRequest("The request body is empty; send a JSON object.")
    probe = _decoded(body, kind)
    _check_required(probe, kind)
    _check_lengths(probe)
    return probe


def _decoded(body: bytes, kind: str) -> Probe:
    try:
        if kind == "embeddings":
            e = _embeddings.decode(body)
            if _absent(e.input):
                raise InvalidRequest("`input` is required.", param="input")
            return Probe(model=e.model, prompt=e.input, user=e.user)
        return _probe.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"Invalid request body: {exc}", param=_field_of(exc)) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The request body is not valid JSON: {exc}") from exc


def _check_required(probe: Probe, kind: str) -> None:
    """The fields this kind of request cannot do without."""
    if not probe.model:
        raise InvalidRequest("`model` must name a model or adapter.", param="model")
    if kind == "chat" and not probe.messages:
        raise InvalidRequest("`messages` must be a non-empty array.", param="messages")
    if kind == "completion" and _absent(probe.prompt):
        raise InvalidRequest("`prompt` is required.", param="prompt")
    if kind == "tokenize" and probe.messages is None and _absent(probe.prompt):
        raise InvalidRequest("`prompt` or `messages` is required.", param="prompt")
    if kind == "responses" and probe.input is None:
        raise InvalidRequest("`input` is required.", param="input")
    if probe.previous_response_id is not None and not probe.previous_response_id:
        raise InvalidRequest("`previous_response_id` must name a response.", param="previous_response_id")


def _check_lengths(probe: Probe) -> None:
    """Each completion length given is at least 1 (checked by name only when one is not)."""
    a, b, c = probe.max_tokens, probe.max_completion_tokens, probe.max_output_tokens
    if (a is not None and a < 1) or (b is not None and b < 1) or (c is not None and c < 1):
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = getattr(probe, name)
            if value is not None and value < 1:
                raise InvalidRequest(f"`{name}` must be at least 1.", param=name)


def _absent(raw: msgspec.Raw) -> bool:
    """A raw field left out of the body, or sent as null."""
    return bytes(raw) in (b"", b"null")


def _field_of(exc: msgspec.ValidationError) -> str | None:
    # msgspec says "... - at `$.field`" or "Object missing required field `field`"
    text = str(exc)
    if "`$." in text:
        return text.split("`$.", 1)[1].split("`", 1)[0].split("[", 1)[0]
    if "required field `" in text:
        return text.split("required field `", 1)[1].split("`", 1)[0]
    return None


def _text(content: str | list[Part] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if p.text)


def separate_prompts(raw: msgspec.Raw) -> list[str | list[int]]:
    """The separate prompts of a completion (or the inputs of an embedding): a string, a
    list of strings, token ids, or a list of token-id lists, each one on its own."""
    if not raw:
        return []
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        return []
    if all(isinstance(x, int) for x in value):
        return [value]
    return [x for x in value if isinstance(x, str | list)]


def _is_batch(probe: Probe) -> bool:
    """Whether the prompt is `prompt` (separate prompts) rather than one conversation."""
    return probe.messages is None and probe.input is None


def prompt_texts(probe: Probe) -> list[str]:
    if probe.messages is not None:
        return [_text(m.content) for m in probe.messages]
    if probe.input is not None:
        texts = [probe.instructions] if probe.instructions else []
        if isinstance(probe.input, str):
            return [*texts, probe.input]
        return [*texts, *(_text(m.content) or m.output or "" for m in probe.input)]
    return [p for p in separate_prompts(probe.prompt) if isinstance(p, str)]


def _messages(probe: Probe) -> int:
    """How many messages a chat template wraps (each adds a few tokens)."""
    if probe.messages is not None:
        return len(probe.messages)
    if isinstance(probe.input, list):
        return len(probe.input) + bool(probe.instructions)
    return 0


def estimate_tokens(probe: Probe) -> tuple[int, int]:
    """(estimate, lower bound) of the prompt's tokens without a tokenizer; for separate
    prompts, of the longest (each must fit the context on its own).

    BPE tokenizers average about 4 bytes a token on prose and code; nothing real
    packs more than about 8 bytes into a token, so bytes/8 is a floor. Token ids
    count exactly.
    """
    if _is_batch(probe):
        sizes = [(len(p), len(p)) if isinstance(p, list) else (math.ceil(len(b := p.encode()) / 4), len(b) // 8)
                 for p in separate_prompts(probe.prompt)]
        return max(sizes, default=(0, 0))
    size = sum(len(t.encode()) for t in prompt_texts(probe))
    overhead = TEMPLATE_TOKENS_PER_MESSAGE * _messages(probe)
    return math.ceil(size / 4) + overhead, size // 8


def prompt_tokens(probe: Probe, kind: str, exact: int | None, counter: TokenCounter | None) -> tuple[int, int]:
    """(estimate, lower bound) of the prompt's tokens: `exact` when the prefix cache counted
    them, else the model's tokenizer's count (`counter`), else `estimate_tokens`."""
    if kind in ("tokenize", "detokenize"):
        return 0, 0  # any length may be tokenized; no context to fit
    if exact is not None:
        return exact, exact
    if counter is not None:
        count = counter.count(probe)
        return count, count
    return estimate_tokens(probe)


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
    if probe.instructions:
        return stable_hash(f"{model}\0{probe.instructions[:PREFIX_CHARS]}"), "prefix"
    if session:
        return stable_hash(f"{model}\0session\0{session}"), "session"
    texts = prompt_texts(probe)
    if texts and texts[0]:
        return stable_hash(f"{model}\0{texts[0][:PREFIX_CHARS]}"), "prefix"
    if _is_batch(probe) and (prompts := separate_prompts(probe.prompt)) and isinstance(prompts[0], list):
        return stable_hash(f"{model}\0ids\0{prompts[0][:PREFIX_CHARS // 4]}"), "prefix"  # token ids: their head
    return None, None


def shared_prefix(probe: Probe, kind: str | None, estimate: int) -> tuple[int, int | None]:
    """(tokens, key) of the prompt's head a request shares with others on a worker, for the KV
    account (gateway/accounts/inflight.py): that of its affinity key (key None: the affinity
    key itself), but for an "adapter" key the system prompt, under a key of its own. Requests
    of one adapter meet by adapter, but an engine shares KV blocks only between requests of
    one adapter (the LoRA id is part of vLLM's block hash) and one prompt, so the account
    counts it once per (adapter, system prompt) on a worker, never once per request."""
    if kind != "adapter":
        return shared_prefix_tokens(probe, kind, estimate), None
    first = probe.messages[0] if probe.messages else None
    if first is None or first.role not in ("system", "developer") or not first.content:
        return 0, None
    text = _text(first.content)
    return min(estimate, math.ceil(len(text.encode()) / 4)), stable_hash(f"{probe.model}\0{text[:PREFIX_CHARS]}")


def shared_prefix_tokens(probe: Probe, kind: str | None, estimate: int) -> int:
    """Tokens of what a "prefix" affinity key stands for (the system prompt or instructions
    the requests share; the head of the first message), at most the prompt's estimate; 0
    for other keys (a session's history is its own)."""
    if kind != "prefix":
        return 0
    first = probe.messages[0] if probe.messages else None
    if first is not None and first.role in ("system", "developer"):
        text = _text(first.content)  # shared whole
    elif first is not None:
        text = _text(first.content)[:PREFIX_CHARS]  # only the head the key hashed is known shared
    elif probe.instructions:
        text = probe.instructions
    else:
        texts = prompt_texts(probe)
        text = texts[0][:PREFIX_CHARS] if texts else ""
    return min(estimate, math.ceil(len(text.encode()) / 4))


class TokenCounter:
    """Exact prompt token counts with a base model's own tokenizer (a tokenizer.json)."""

    def __init__(self, path: str, max_chars: int = CACHED_CHARS) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self.max_chars = max_chars
        self.tokenizer = Tokenizer.from_file(path)
        # Long texts' token counts, by their exact text (the same text always encodes alike).
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._chars = 0

    def count(self, probe: Probe) -> int:
        """The prompt's tokens; for separate prompts, the longest one's."""
        if _is_batch(probe):
            prompts = separate_prompts(probe.prompt)
            texts = [p for p in prompts if isinstance(p, str) and p]
            encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False) if texts else []
            return max([len(e.ids) for e in encoded] + [len(p) for p in prompts if isinstance(p, list)], default=0)
        texts = [t for t in prompt_texts(probe) if t]
        return self.texts(texts) + TEMPLATE_TOKENS_PER_MESSAGE * _messages(probe)

    def texts(self, texts: list[str]) -> int:
        """The tokens of `texts`, each encoded on its own; a long text seen lately is not
        encoded again."""
        counts = self._counts
        total = 0
        missing: list[str] = []
        for text in texts:
            n = counts.get(text)
            if n is None:
                missing.append(text)
            else:
                counts.move_to_end(text)
                total += n
        if not missing:
            return total
        for text, encoding in zip(missing, self.tokenizer.encode_batch(missing, add_special_tokens=False), strict=True):
            n = len(encoding.ids)
            total += n
            if len(text) >= CACHED_TEXT_CHARS and text not in counts:
                counts[text] = n
                self._chars += len(text)
        while self._chars > self.max_chars:
            gone, _ = counts.popitem(last=False)
            self._chars -= len(gone)
        return total
