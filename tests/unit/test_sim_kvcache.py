"""The simulator's KV cache holds the blocks that generated tokens fill, as vLLM's does: the
scheduler stepped by hand (no clock, no process), its block pool reporting to a recorder,
and the generated ids a tokenizer gives back when it re-encodes the answer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_simulator import _run_until_done, _sched, _seq, _submit
from tests.e2e.test_simulator_generated_cache import make_chat_model
from workers.simulator.kvcache import block_hashes
from workers.simulator.tokens import ByteTokens, TextSource, load_tokens

BS = 16


class Recorder:
    """A KvEventSink that keeps what it is told."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def stored(self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               block_size: int, lora_name: str | None) -> None:  # fmt: skip
        self.events.append(("stored", list(hashes), parent, list(token_ids)))

    def removed(self, block_hash: int) -> None:
        self.events.append(("removed", block_hash))

    def cleared(self) -> None:
        self.events.append(("cleared",))


def test_decode_filled_blocks_are_cached_with_their_generated_ids() -> None:
    """A 40-token prompt generating 30 tokens computes 69: two prompt blocks cached at
    admission, then two blocks filled by decode, each cached and reported as it fills with
    the sequence's own ids (prompt tail and generated), under the prompt's hash chain, so a
    later prompt with those ids finds all four by hash."""
    s, _ = _sched(blocks=16, bs=BS)
    rec = Recorder()
    s.pool.events = rec
    seq = _seq("a", list(range(1000, 1040)), out=30)
    _submit(s, seq)
    _run_until_done(s)
    ids = seq.token_ids()
    assert len(ids) == 70 and seq.output_ids == ids[40:]
    hashes = block_hashes(ids, BS, "")
    assert rec.events == [
        ("stored", hashes[:2], None, ids[:32]),
        ("stored", hashes[2:3], hashes[1], ids[32:48]),  # 8 prompt + 8 generated
        ("stored", hashes[3:4], hashes[2], ids[48:64]),  # generated only
    ]
    assert len(s.pool.lookup(hashes, 4)) == 4
    again = _seq("b", ids[:64] + [7] * 10)
    _submit(s, again)
    s.step()
    assert again.cached_tokens == 64


def test_finished_answers_blocks_are_evicted_like_a_prompts() -> None:
    """A finished sequence's blocks go to the free queue tail first, generated ones
    included: taking every block evicts the answer's blocks before the prompt's head."""
    s, _ = _sched(blocks=6, bs=BS)
    rec = Recorder()
    s.pool.events = rec
    seq = _seq("a", list(range(1000, 1040)), out=30)  # 5 blocks held, 4 of them cached
    _submit(s, seq)
    _run_until_done(s)
    hashes = block_hashes(seq.token_ids(), BS, "")
    assert s.pool.num_used == 0
    rec.events.clear()
    s.pool.release(s.pool.allocate(6))
    assert rec.events == [("removed", h) for h in reversed(hashes[:4])]


def test_preempted_sequence_keeps_its_generated_chain() -> None:
    """A sequence preempted mid-answer and admitted again hashes the blocks it fills next on
    the same chain: what it caches is what one unpreempted run caches."""
    runs = []
    for blocks in (8, 64):
        s, hooks = _sched(blocks=blocks, bs=BS)
        a, b = _seq("a", [1] * 40, out=30), _seq("b", [2] * 40, out=40)
        _submit(s, a)
        _submit(s, b)
        _run_until_done(s)
        runs.append((hooks.preempted, b.hashes, b.token_ids()))
    (pressed, hashes, ids), (calm, calm_hashes, calm_ids) = runs
    assert pressed == 1 and calm == 0
    assert ids == calm_ids and hashes == calm_hashes == block_hashes(ids, BS, "")[: len(hashes)]
    assert len(hashes) == (40 + 40 - 1) // BS


def test_byte_estimate_generates_one_piece_per_token() -> None:
    """Without a tokenizer each piece is one token (its bytes as the id): the text is the
    pieces', as before."""
    tokens, pieces = TextSource(5), TextSource(5)
    out = [tokens.token() for _ in range(200)]
    assert [text for _, text in out] == [pieces.piece() for _ in range(200)]
    assert [i for i, _ in out] == [ByteTokens().encode(text)[0] for _, text in out]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("model"), files=10)


@pytest.mark.parametrize("seed", range(20))
def test_generated_ids_are_the_answers_own_tokens(chat_model: Path, seed: int) -> None:
    """With a real tokenizer the pieces are cut into its tokens word by word: the answer's
    text encodes to exactly the ids generated (so a quoted answer hits its blocks), and the
    text is the same pieces' text, only cut finer."""
    tokens = load_tokens(str(chat_model))
    src = TextSource(seed, tokens)
    out = [src.token() for _ in range(150)]
    text = "".join(t for _, t in out)
    ids = [i for i, _ in out]
    words = tokens.words(text)
    assert words is not None and len(words) > 10
    whole = tokens.encode(text[: len(text) - len(words[-1])])  # the last word may be cut short
    assert ids[: len(whole)] == whole and len(ids) - len(whole) < 10
    pieces = TextSource(seed)
    drawn = ""
    while len(drawn) < len(text):
        drawn += pieces.piece()
    assert drawn.startswith(text)


def test_words_a_tokenizer_cannot_write_back_fall_back_to_bytes(tmp_path: Path) -> None:
    """A tokenizer that cannot encode the answer's characters (a tiny vocabulary with no
    unknown token) or does not decode a word back to itself (a prefix space): byte chunks
    stand for those words, and the text is still the pieces' text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()  # adds a prefix space
    tok.train_from_iterator(["hello world, the simulator speaks"] * 20, trainers.BpeTrainer(vocab_size=300))
    tok.save(str(tmp_path / "tokenizer.json"))
    src = TextSource(3, load_tokens(str(tmp_path)))
    text = "".join(src.token()[1] for _ in range(100))
    pieces = TextSource(3)
    drawn = ""
    while len(drawn) < len(text):
        drawn += pieces.piece()
    assert drawn.startswith(text)
