"""Tokens in and text out.

Prompts are counted with the model folder's tokenizer.json when there is one; otherwise
with a byte-level estimate a gateway can mirror: ceil(utf-8 bytes / 4), each 4-byte chunk
standing for one token id. Chat messages are rendered ChatML-style before counting, with the
system message that the model's chat template adds when the messages bring none (Qwen's
templates and the tiny model's do), so that a chat prompt counts as many tokens as in vLLM.

The text a sequence generates is pseudo-words from a seeded RNG, cut into the model's
tokens, so that what is streamed, what usage reports and what the scheduler counted agree,
and so that the ids a sequence generated are the ids its text has when a later prompt
quotes it (a chat's next turn): vLLM caches the blocks of generated tokens too, and they
hit only as far as the re-tokenized answer matches (TextSource).
"""

from __future__ import annotations

import math
import random
import re
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from fleetgate.chat_template import ChatTemplate, load_chat_template, read_template

MEAN_OUTPUT_TOKENS = 200

_SYLLABLES = (
    "ka", "lo", "mi", "ren", "ta", "vo", "si", "del", "an", "or", "be", "qu", "ne", "tor",
    "il", "um", "sa", "pe", "ri", "gon", "ex", "ly", "mar", "chi", "tu", "fen", "ob", "ra",
)  # fmt: skip


class Tokens(Protocol):
    # The system message the model's chat template adds when there is none (None: no such
    # default); see default_system().
    chat_system: str | None
    # The model's own chat template, rendered as vLLM renders it; None: ChatML (render_chat).
    template: ChatTemplate | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def token_strs(self, ids: Sequence[int]) -> list[str]: ...
    def known(self, token_id: int) -> bool: ...
    def words(self, text: str) -> list[str] | None:
        """`text` cut where the tokenizer cuts it before encoding (its pre-tokens, which it
        encodes one by one), covering the whole text; None: it has no such cuts."""
        ...


class ByteTokens:
    """One token per 4 bytes of UTF-8: ceil(len(bytes) / 4) tokens."""

    chat_system: str | None = None
    template: ChatTemplate | None = None

    def encode(self, text: str) -> list[int]:
        raw = text.encode()
        return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]

    @staticmethod
    def _chunk(token_id: int) -> bytes:
        # A short last chunk was zero-padded by int.from_bytes; its zero bytes go.
        return token_id.to_bytes(4, "little").rstrip(b"\x00")

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(map(self._chunk, ids)).decode(errors="replace")

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self._chunk(i).decode(errors="replace") for i in ids]

    def known(self, token_id: int) -> bool:
        return 0 <= token_id < 2**32

    def words(self, text: str) -> list[str] | None:
        return None


class FileTokens:
    """A real tokenizer from a model folder's tokenizer.json."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.chat_system = default_system(path.parent)
        self.template = load_chat_template(path.parent)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "" for i in ids]

    def known(self, token_id: int) -> bool:
        return 0 <= token_id < self._tok.get_vocab_size(with_added_tokens=True)

    def words(self, text: str) -> list[str] | None:
        pre = self._tok.pre_tokenizer
        if pre is None:
            return None
        starts = [start for _, (start, _) in pre.pre_tokenize_str(text)]
        if not starts:
            return []
        starts[0] = 0
        return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]


_BYTES = ByteTokens()
# Drawn text that a tokenizer never cuts is encoded as one word at this length.
_LONGEST_WORD = 64

# A ChatML system turn written as one literal in a Jinja template: the template's default.
_DEFAULT_SYSTEM = re.compile(r"""['"]<\|im_start\|>system\\n([^'"+{}]*?)<\|im_end\|>\\n['"]""")


def default_system(folder: Path) -> str | None:
    """The content of the system message the folder's ChatML chat template adds when the
    messages do not open with one (e.g. "You are a helpful assistant."), read from the
    template as a literal; None when it has none. Only this part of a template is honoured:
    the rest is rendered ChatML-style (render_chat)."""
    found = _DEFAULT_SYSTEM.search(read_template(folder))
    return found.group(1).replace("\\n", "\n") if found else None


def load_tokens(model: str) -> Tokens:
    path = Path(model) / "tokenizer.json"
    return FileTokens(path) if path.is_file() else ByteTokens()


def estimate_tokens(text: str) -> int:
    """The byte-level estimate, for callers that only need the count."""
    return math.ceil(len(text.encode()) / 4)


def message_text(content: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise ValueError("message content must be a string or a list of parts")


def render_chat(
    messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool, continue_final: bool,
    default_system: str | None = None,
) -> str:  # fmt: skip
    """ChatML: `<|im_start|>role\\ncontent<|im_end|>\\n` per message.

    Continuing leaves the final (assistant) message open; otherwise the generation prompt
    opens a new assistant turn. `default_system` opens the chat when the messages do not
    start with a system message (the model's template's default, see default_system()).
    """
    parts = []
    if default_system is not None and messages and messages[0].get("role") != "system":
        parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
    for i, msg in enumerate(messages):
        text = f"<|im_start|>{msg['role']}\n{message_text(msg.get('content'))}"
        if not (continue_final and i == len(messages) - 1):
            text += "<|im_end|>\n"
        parts.append(text)
    if add_generation_prompt and not continue_final:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def render_prompt(
    tokens: Tokens, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool, continue_final: bool,
) -> str:  # fmt: skip
    """The chat's prompt text: with the model's chat template where its folder has one (as
    vLLM renders it), else ChatML (render_chat). ValueError: messages it cannot render."""
    if tokens.template is None:
        return render_chat(messages, add_generation_prompt=add_generation_prompt, continue_final=continue_final,
                           default_system=tokens.chat_system)
    for msg in messages:
        message_text(msg.get("content"))  # the content's shape, checked as render_chat does
    try:
        return tokens.template.render(messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final)
    except Exception as exc:  # the template refused them (raise_exception), or a type error
        raise ValueError(f"the chat template cannot render these messages: {exc}") from exc


class TextSource:
    """A sequence's output: word pieces and an end-of-sequence point drawn from one seeded
    RNG, cut into the tokens of `tokens` (the byte estimate when None).

    A real model emits token ids and its text is their decoding; re-tokenizing that text
    (the next turn of a chat quotes the answer) mostly gives the same ids back, because a
    model's tokens are the tokenizer's own cuts. So the pieces are joined into the
    tokenizer's words (pre-tokens: a word is encoded once the piece after it shows where it
    ends) and each word's ids are the generated tokens: the answer's ids are then the ids
    its text encodes to, and its cached blocks hit when a later prompt quotes it. The byte
    estimate has no words: each piece (at most 4 bytes) is one token, as before.
    """

    def __init__(self, seed: int, tokens: Tokens | None = None) -> None:
        self._rng = random.Random(seed)
        self._started = False
        self._tokens = tokens if tokens is not None else _BYTES
        self._ahead = ""  # drawn, not yet tokenized: the word that may still go on
        self._ready: deque[tuple[int, str]] = deque()

    def token(self) -> tuple[int, str]:
        """The next generated token: its id and its text."""
        while not self._ready:
            self._ahead += self.piece()
            words = self._tokens.words(self._ahead)
            if words is not None and len(words) < 2 and len(self._ahead) < _LONGEST_WORD:
                continue  # the word may go on
            if words is None or len(words) < 2:
                done, self._ahead = [self._ahead], ""
            else:
                done, self._ahead = words[:-1], words[-1]
            for word in done:
                self._queue(word)
        return self._ready.popleft()

    def _queue(self, word: str) -> None:
        tokens = self._tokens
        try:
            ids = tokens.encode(word)
        except Exception:  # e.g. a character outside a vocabulary without an unknown token
            ids = []
        if not ids or tokens.decode(ids) != word:
            # The tokenizer cannot write this word back (unknown characters, a prefix space
            # it adds): the byte estimate's chunks stand for it, so the text is the pieces'.
            tokens = _BYTES
            ids = tokens.encode(word)
        shown = ""
        for k in range(len(ids)):
            text = tokens.decode(ids[: k + 1])
            self._ready.append((ids[k], text[len(shown) :]))
            shown = text

    def eos_after(self, mean: int = MEAN_OUTPUT_TOKENS) -> int:
        """Tokens before a natural stop: geometric with the given mean."""
        u = self._rng.random()
        return 1 + int(math.log(1.0 - u) / math.log(1.0 - 1.0 / mean))

    def piece(self) -> str:
        syllable = self._rng.choice(_SYLLABLES)
        roll = self._rng.random()
        if not self._started:
            self._started = True
            return syllable.capitalize()
        if roll < 0.06:
            return "."
        if roll < 0.1:
            return ","
        if roll < 0.6:
            return " " + syllable
        return syllable
