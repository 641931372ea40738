"""A chat's token ids, tokenized piece by piece, with the pieces' ids kept for the next request.

Precise prefix routing (gateway/request/prefix_cache.py) needs each chat's token ids, and
tokenizing a ~6 kB prompt costs milliseconds of the event loop's time, while most of it (a
system prompt, a document, the earlier turns) is text the gateway tokenized a moment ago. A
chat template renders those parts as the same text between its special tokens
(`<|im_start|>`, `<|im_end|>`, `<|eot_id|>`, ...), and a Hugging Face tokenizer cuts its input
at its added tokens before anything else, then normalizes, pre-tokenizes and merges each piece
between them on its own (tokenizers' `AddedVocabulary::extract_and_normalize`): BPE never
merges across such a token. So the whole text's ids are its pieces' ids end to end, cut at
those tokens, and a piece seen before costs a dict look-up. The template is still rendered
whole for every request (a template may change earlier text for later messages); only the
tokenizing is cached, by the pieces' exact text.

`PieceTokenizer.encode(text)` is `tokenizer.encode(text, add_special_tokens=False).ids`. It
cuts only where that cannot change the answer, else it encodes the whole text:

- at added tokens matched on the raw text (`normalized` false), without `lstrip`, `rstrip` or
  `single_word`, that begin and end with a character that is neither a word character nor
  whitespace, and that no other added token can overlap (the tokenizer's leftmost-longest match
  would take that one instead);
- only with pre-tokenizers that treat every piece alike (`_PER_PIECE`): a Metaspace that
  prepends to the first piece only (prepend_scheme "first") does not, since it knows the first
  piece by its offset in the whole text.

Belt and braces: the first `verify` encodes that tokenized a new piece are checked against the
whole text's encode; a difference logs `gateway.piece_tokens_mismatch` and turns the cutting
off for that tokenizer (whole-text encodes from then on).

The cache is an LRU bounded by the tokens it holds (`max_tokens`, 2^19: ~20 MB of lists and
texts at most; 16 system prompts of 1,700 tokens take 27k); one per tokenizer, owned by the
prefix cache that create_app builds.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = structlog.get_logger("gateway.token_pieces")

__all__ = ["PieceTokenizer", "cut_tokens"]

# Pre-tokenizers that split and map every piece the same way whatever its place in the text.
_PER_PIECE = frozenset({
    "BertPreTokenizer", "ByteLevel", "CharDelimiterSplit", "Digits", "Punctuation", "Split",
    "UnicodeScripts", "Whitespace", "WhitespaceSplit",
})  # fmt: skip


def _pieces_alike(pre: Any) -> bool:
    """Whether a pre-tokenizer (tokenizer.json's config) handles each piece on its own terms."""
    if pre is None:
        return True
    if not isinstance(pre, dict):
        return False
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_pieces_alike(p) for p in pre.get("pretokenizers") or [])
    if kind == "Metaspace":
        return pre.get("prepend_scheme") in ("always", "never")
    return kind in _PER_PIECE


def _edge_ok(ch: str) -> bool:
    return not (ch.isspace() or ch.isalnum() or ch == "_")


def cut_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The added tokens a text can be cut at without changing its ids (content -> id); {}
    when none, or when the tokenizer's pre-tokenizer does not treat pieces alike."""
    pre = tokenizer.pre_tokenizer
    try:
        config = None if pre is None else json.loads(pre.__getstate__())
    except Exception:  # not serializable: no way to know what it does
        return {}
    if not _pieces_alike(config) or getattr(tokenizer, "encode_special_tokens", False):
        return {}  # (special tokens encoded as text: not cut there by the tokenizer)
    added = tokenizer.get_added_tokens_decoder()
    raw = [t.content for t in added.values() if not t.normalized and t.content]
    cuts: dict[str, int] = {}
    for token_id, t in sorted(added.items()):
        c = t.content
        if not c or t.normalized or t.lstrip or t.rstrip or t.single_word or c in cuts:
            continue
        if not (_edge_ok(c[0]) and _edge_ok(c[-1])):
            continue
        if any(_overlaps(other, c) for other in raw if other != c):
            continue
        cuts[c] = token_id
    return cuts


def _overlaps(other: str, token: str) -> bool:
    """Whether a match of `other` could start at or before a match of `token` and reach into
    it (or start with it and be longer): then the tokenizer may match `other` there."""
    k = other.find(token[0])
    while k >= 0:  # a tail of `other` that begins as `token` does
        tail = other[k:]
        if token.startswith(tail) or tail.startswith(token):
            return True
        k = other.find(token[0], k + 1)
    return False


class PieceTokenizer:
    """One tokenizer's chat encodes, with its pieces' ids in an LRU bounded by `max_tokens`;
    `cut` False: every text encoded whole (as before; scripts/bench_prefix_tokens.py)."""

    def __init__(self, tokenizer: Tokenizer, *, cut: bool = True, max_tokens: int = 1 << 19, verify: int = 8) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.verify = verify
        self._ids = cut_tokens(tokenizer) if cut else {}
        self._cut: re.Pattern[str] | None = None
        if self._ids:
            self._cut = re.compile("|".join(re.escape(c) for c in sorted(self._ids, key=len, reverse=True)))
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._held = 0  # tokens in _pieces
        self.hits = 0
        self.misses = 0

    @property
    def cuts(self) -> bool:
        """Whether texts are cut into pieces (else each is encoded whole)."""
        return self._cut is not None

    def whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode(self, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False).ids`."""
        cut = self._cut
        if cut is None:
            return self.whole(text)
        ids: list[int] = []
        at = 0
        missed = self.misses
        for m in cut.finditer(text):
            start = m.start()
            if start > at:
                ids += self._piece(text[at:start])
            ids.append(self._ids[m.group()])
            at = m.end()
        if at < len(text):
            ids += self._piece(text[at:])
        if self.verify > 0 and self.misses != missed:
            self.verify -= 1
            whole = self.whole(text)
            if whole != ids:
                log.warning("gateway.piece_tokens_mismatch", chars=len(text), tokens=len(whole))
                self._cut = None
                self._pieces.clear()
                self._held = 0
                return whole
        return ids

    def _piece(self, text: str) -> list[int]:
        pieces = self._pieces
        found = pieces.get(text)
        if found is not None:
            pieces.move_to_end(text)
            self.hits += 1
            return found
        self.misses += 1
        ids = self.whole(text)
        if len(ids) <= self.max_tokens:
            pieces[text] = ids
            self._held += len(ids)
            while self._held > self.max_tokens:
                _, gone = pieces.popitem(last=False)
                self._held -= len(gone)
        return ids
