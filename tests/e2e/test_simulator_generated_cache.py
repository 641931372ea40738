"""The simulator caches the blocks its answers fill, as vLLM does: a real simulator process
with a real byte-level BPE tokenizer (Qwen2's pre-tokenizing split, ChatML template), a
two-turn chat whose second turn quotes the first answer, and the engine's KV cache events
read back over its ZMQ replay socket."""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from fleetgate.kv_events import (
    BlockStored,
    EventBatch,
    decode_batch,
    parse_replay_reply,
    replay_request,
)
from fleetgate.net import free_port
from tests.e2e.test_simulator import Sim, start

BS = 16
ANSWER = 64  # generated tokens of turn 1 (ignore_eos): at least three blocks of answer
# The model folder that `make vllm` builds (scripts/make_tiny_model.py), tokenizer only:
# its template, special tokens and pre-tokenizing split, trained on fewer stdlib files.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
QWEN2_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def make_chat_model(folder: Path, files: int = 30) -> Path:
    """A tokenizer-only model folder shaped like the tiny model's (a byte-level BPE on the
    first `files` stdlib sources: the same text on every machine with this Python)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(str(p) for p in stdlib.glob("*.py"))[:files]
    tok.train(sources, trainers.BpeTrainer(
        vocab_size=4096, min_frequency=2, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    ))  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


class EventsSim:
    """A simulator with a tokenizer and KV cache events (a replay socket to read them back)."""

    def __init__(self, model: Path) -> None:
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{free_port()}", "replay_endpoint": self.replay,
                  "topic": "kv"}  # fmt: skip
        self.sim: Sim = start("--model", str(model), "--block-size", str(BS), "--max-model-len", "4096",
                              "--kv-events-config", json.dumps(config))  # fmt: skip

    def events(self) -> list[Any]:
        """Every event the engine has published, in order (its replay buffer)."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.connect(self.replay)
        try:
            sock.send_multipart(replay_request(0))
            batches: list[EventBatch] = []
            while (reply := parse_replay_reply(sock.recv_multipart()))[0] >= 0:
                batches.append(decode_batch(reply[1]))
        finally:
            sock.close()
            ctx.term()
        return [e for b in batches for e in b.events]

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
        body = {"model": "base", "messages": messages, "max_tokens": max_tokens,
                "ignore_eos": True, "seed": 11}  # fmt: skip
        resp = httpx.post(self.sim.url + "/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def tokenize(self, messages: list[dict[str, str]]) -> list[int]:
        resp = httpx.post(self.sim.url + "/tokenize", json={"model": "base", "messages": messages})
        return list(resp.json()["tokens"])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventsSim]:
    server = EventsSim(make_chat_model(tmp_path_factory.mktemp("chat-model")))
    yield server
    server.sim.stop()


def test_second_turn_hits_the_first_answers_blocks(engine: EventsSim) -> None:
    """Turn 1's decode caches each block its answer fills, published as BlockStored with the
    generated token ids chained after the prompt's blocks; those ids are what the answer's
    text re-tokenizes to, so turn 2 (turn 1's chat, the answer verbatim, a new question)
    reports every block turn 1 computed as cached, the answer's full blocks included."""
    question = [{"role": "user", "content": "Describe the delta of the northern river. " * 12}]
    first = engine.chat(question, ANSWER)
    prompt1 = first["usage"]["prompt_tokens"]
    assert first["usage"]["completion_tokens"] == ANSWER
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answer = first["choices"][0]["message"]["content"]
    follow = [*question, {"role": "assistant", "content": answer},
              {"role": "user", "content": "And the southern one?"}]  # fmt: skip
    # Turn 1 computed its prompt and all but its last sampled token: full blocks of answer.
    computed = (prompt1 + ANSWER - 1) // BS
    prompt_blocks = prompt1 // BS
    assert computed - prompt_blocks >= 3

    stored = [e for e in engine.events() if isinstance(e, BlockStored)]
    # The prompt's blocks at admission, then one event per block as decode filled it.
    assert [len(e.block_hashes) for e in stored] == [prompt_blocks] + [1] * (computed - prompt_blocks)
    chain = [h for e in stored for h in e.block_hashes]
    assert [e.parent_block_hash for e in stored] == [None, *chain[prompt_blocks - 1:-1]]
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens == engine.tokenize(follow)[: computed * BS]  # the answer re-tokenized
    text = httpx.post(engine.sim.url + "/detokenize", json={"model": "base", "tokens": tokens[prompt1:]})
    assert answer.startswith(text.json()["prompt"])  # and what was generated

    second = engine.chat(follow, 1)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == computed * BS  # before: prompt_blocks * BS, the prompt's blocks only
    assert engine.sim.metrics()["vllm:prefix_cache_hits_total"] == cached
    # Turn 2 stored only its own new blocks, chained to the answer's last.
    new = [e for e in engine.events() if isinstance(e, BlockStored)][len(stored) :]
    assert new and new[0].parent_block_hash == chain[-1]
