"""A chat's ids tokenized piece by piece with cached pieces (gateway/request/token_pieces.py) are
exactly the whole text's ids: table-driven against `tokenizer.encode(text)` for several
tokenizers (byte-level BPE with ChatML tokens, Metaspace, tokens with lstrip / rstrip,
overlapping and normalized added tokens) and prompts, including ones where a naive cache of a
text prefix would be wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from fleetgate.chat_template import load_chat_template
from gateway.request.prefix_cache import PromptTokens
from gateway.request.requests import TokenCounter
from gateway.request.token_pieces import PieceTokenizer, cut_tokens
from gateway.wire import Probe

CHATML_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CORPUS = [
    "hello world helloworld the system prompt says hello to the world  \n\n",
    "you are a helpful assistant. answer the question 12345 in full.\n",
    "café cafe\u0301 naïve résumé 日本語 テキスト",
    "def f(x):\n    return x + 1\n\n\n",
] * 20


def _train(pre: Any, special: list[str], norm: Any = None) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if norm is not None:
        tok.normalizer = norm
    tok.pre_tokenizer = pre
    alphabet = pre_tokenizers.ByteLevel.alphabet() if "ByteLevel" in repr(pre) else []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def byte_level() -> Tokenizer:
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return _train(pre, CHATML_TOKENS, normalizers.NFC())


def metaspace_first() -> Tokenizer:
    return _train(pre_tokenizers.Metaspace(prepend_scheme="first"), CHATML_TOKENS)


def stripping() -> Tokenizer:
    """<|im_end|> eats the whitespace around it; <|im_start|> stays a cut."""
    tok = byte_level()
    tok.add_special_tokens([AddedToken("<|im_end|>", lstrip=True, rstrip=True, normalized=False)])
    return tok


def overlapping() -> Tokenizer:
    """An added token that can begin before <|im_end|> and run into it."""
    tok = byte_level()
    tok.add_tokens([AddedToken("x<|im_e", normalized=False)])
    tok.add_tokens([AddedToken("hello", normalized=True)])
    return tok


TOKENIZERS = {"byte-level": byte_level, "metaspace-first": metaspace_first, "stripping": stripping,
              "overlapping": overlapping}  # fmt: skip

SYSTEM = "You are a helpful assistant. " * 40
TEXTS = [
    ("one chat", f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"),
    ("no special token", "hello world helloworld"),
    ("empty", ""),
    ("only special tokens", "<|im_start|><|im_end|><|im_end|>"),
    # A cut in the middle of a word: "hello" | "world" would merge differently from "helloworld".
    ("a word across a special token", "hel<|im_end|>loworld helloworld"),
    # `\s+(?!\S)` keeps a trailing space apart when text follows; at a piece's end it does not.
    ("spaces before a special token", "hello   <|im_end|>   world  \n\n<|im_start|> \n"),
    ("combining accent after a special token", "cafe<|im_end|>\u0301 caf\u0301e<|im_start|>e\u0301"),
    ("digits across a special token", "123<|im_end|>456 789"),
    ("text before an overlapping token", "ax<|im_end|>b x<|im_e"),
    ("the system prompt again, another question",
     f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nworld  \n<|im_end|>\n"),
    ("the system prompt's text with more after it", f"<|im_start|>system\n{SYSTEM}and more<|im_end|>\n"),
]


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return TOKENIZERS[request.param]()


def whole(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def test_pieces_give_the_whole_texts_ids(tokenizer: Tokenizer) -> None:
    pieces = PieceTokenizer(tokenizer, verify=0)  # no check against the whole: the table is the check
    for _ in range(2):  # the second time from the cache
        for why, text in TEXTS:
            assert pieces.encode(text) == whole(tokenizer, text), why
    assert pieces.hits > 0 or not pieces.cuts


def test_where_it_cuts() -> None:
    assert set(cut_tokens(byte_level())) == set(CHATML_TOKENS)
    assert cut_tokens(metaspace_first()) == {}  # the first piece alone gets the prefix
    assert set(cut_tokens(stripping())) == {"<|endoftext|>", "<|im_start|>"}
    assert set(cut_tokens(overlapping())) == {"<|endoftext|>", "<|im_start|>"}


def test_a_naive_prefix_cut_would_be_wrong() -> None:
    """What the table guards against: tokenizing a text's prefix apart changes the ids."""
    tok = byte_level()
    assert whole(tok, "helloworld") != whole(tok, "hel") + whole(tok, "loworld")  # BPE merges across
    assert whole(tok, "hello world") != whole(tok, "hello ") + whole(tok, "world")  # the space goes right
    for text in ("hel<|im_end|>loworld", "hello <|im_start|>world"):
        assert PieceTokenizer(tok).encode(text) == whole(tok, text)


def test_the_cache_is_bounded_by_tokens() -> None:
    tok = byte_level()
    pieces = PieceTokenizer(tok, max_tokens=200, verify=0)
    for k in range(20):
        text = f"<|im_start|>user\nquestion {k}: {SYSTEM[: 50 + k]}<|im_end|>\n"
        assert pieces.encode(text) == whole(tok, text)
    assert 0 < pieces._held <= 200
    assert pieces._held == sum(len(ids) for ids in pieces._pieces.values())


class _Breaks:
    """A tokenizer whose pieces do not add up to the whole (an extra id per encode)."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def encode(self, sequence: str, add_special_tokens: bool = False) -> Any:
        class _E:
            ids = [*self.tok.encode(sequence, add_special_tokens=add_special_tokens).ids, 0]

        return _E()

    def get_added_tokens_decoder(self) -> Any:
        return self.tok.get_added_tokens_decoder()

    @property
    def pre_tokenizer(self) -> Any:
        return self.tok.pre_tokenizer


def test_a_mismatch_turns_the_cutting_off() -> None:
    broken = cast(Tokenizer, _Breaks(byte_level()))
    pieces = PieceTokenizer(broken)
    text = TEXTS[0][1]
    assert pieces.cuts
    assert pieces.encode(text) == list(broken.encode(text).ids)
    assert not pieces.cuts
    assert pieces.encode(text) == list(broken.encode(text).ids)


# A template that writes later messages' count into the system prompt: the text before the
# question changes with the conversation, so a cache of the first message's text would be stale.
COUNTING = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{%- if loop.first %}{{- ' (' ~ (messages|length) ~ ' messages)' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "world"}, {"role": "user", "content": "helloworld  "}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "world"}],
    [{"role": "system", "content": SYSTEM + "hello"}, {"role": "user", "content": "123"}],
]


@pytest.mark.parametrize("template", [CHATML, COUNTING, PLAIN], ids=["chatml", "counting", "plain"])
def test_prompt_tokens_are_the_uncached_ones(tmp_path: Path, template: str) -> None:
    tok = byte_level()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    counter = TokenCounter(str(tmp_path / "tokenizer.json"))
    cached = PromptTokens(counter, load_chat_template(tmp_path))
    uncached = PromptTokens(counter, load_chat_template(tmp_path), cut=False)
    assert cached.pieces.cuts and not uncached.pieces.cuts
    for _ in range(2):
        for messages in CHATS:
            probe = msgspec.json.decode(msgspec.json.encode({"model": "m", "messages": messages}), type=Probe)
            ids = uncached.ids(probe)
            assert ids is not None
            assert cached.ids(probe) == ids


def test_token_counts_of_long_texts_are_kept_and_stay_exact(tmp_path: Path) -> None:
    """TokenCounter keeps long texts' counts (a system prompt sent again is not encoded again):
    each count equals a fresh encode's, the second round is answered from the cache, and the
    cache stays within its character bound, oldest out first."""
    from gateway.request import requests

    tok = byte_level()
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = TokenCounter(str(tmp_path / "tokenizer.json"))
    texts = [SYSTEM, SYSTEM + "hello", "short question", SYSTEM * 2, "naïve café " * 40]

    def fresh(batch: list[str]) -> int:
        return sum(len(tok.encode(t, add_special_tokens=False).ids) for t in batch)

    for _ in range(2):
        for i in range(len(texts)):
            assert counter.texts(texts[: i + 1]) == fresh(texts[: i + 1])
    long = [t for t in texts if len(t) >= requests.CACHED_TEXT_CHARS]
    assert set(counter._counts) == set(long) and "short question" not in counter._counts
    small = TokenCounter(str(tmp_path / "tokenizer.json"), max_chars=len(SYSTEM) + len(SYSTEM + "hello"))
    for text in (SYSTEM, SYSTEM + "hello", SYSTEM * 2):
        assert small.texts([text]) == fresh([text])
    assert list(small._counts) == [SYSTEM * 2] and small._chars == len(SYSTEM * 2)
