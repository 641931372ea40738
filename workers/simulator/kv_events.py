"""The simulator's KV cache events: vLLM's ZMQ publisher, in vLLM's wire format.

`--kv-events-config` takes vLLM's JSON (`{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}`), and
the publisher behaves as vLLM 0.26's ZmqEventPublisher (vllm/distributed/kv_events.py):

- a PUB socket that binds when the endpoint has a wildcard (`*`, `::`) or is ipc/inproc, and
  connects otherwise (vLLM's "bind stable, connect volatile" rule), sending
  `[topic, seq, payload]` with `seq` counting from 0;
- a ROUTER replay socket (always bound) answering `[b"", start_seq]` with every buffered batch
  from start_seq on and the -1 end marker; the last `buffer_steps` batches are kept.

The block pool (kvcache.py) reports to it; the events of one engine step go out as one batch,
as vLLM's scheduler publishes what `take_events()` returns after each step: the first event
of a step schedules the flush for when the step's synchronous scheduling is over
(`loop.call_soon`). Wire encoding: fleetgate/kv_events.py.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Literal

import msgspec
import structlog
import zmq
import zmq.asyncio

from fleetgate.background import stop_tasks
from fleetgate.kv_events import (
    END_SEQ,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    encode_batch,
    encode_seq,
)

__all__ = ["KvEventsConfig", "SimKvPublisher"]

log = structlog.get_logger("sim.kv_events")

_U64 = (1 << 64) - 1


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's KVEventsConfig (vllm/config/kv_events.py), the fields the simulator honours."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.DecodeError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from exc

    @property
    def publishes(self) -> bool:
        """Whether a ZMQ publisher runs (vLLM: publisher defaults to zmq when enabled)."""
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind wildcard and ipc/inproc endpoints, connect others."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _u64(h: int) -> int:
    # vLLM reports the low 64 bits of its hashes, unsigned; the simulator's are Python hashes.
    return h & _U64


class SimKvPublisher:
    """A KvEventSink (workers/simulator/kvcache.py) that publishes over ZMQ."""

    def __init__(self, config: KvEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._pending: list[KVCacheEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._lora_ids: dict[str, int] = {}
        self._flush_scheduled = False
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        """Open the sockets and serve replays (on the running loop)."""
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(self.config.endpoint):
            self._pub.bind(self.config.endpoint)
        else:
            self._pub.connect(self.config.endpoint)
        if self.config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            # A whole buffer fits in one answer (a ROUTER drops what exceeds its high-water mark).
            self._replay.setsockopt(zmq.SNDHWM, self.config.buffer_steps + 2)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.config.replay_endpoint)
            self._replay_task = asyncio.create_task(self._serve_replay(), name="sim-kv-replay")
        log.info("sim.kv_events_started", endpoint=self.config.endpoint,
                 replay=self.config.replay_endpoint, topic=self.config.topic)  # fmt: skip

    async def aclose(self) -> None:
        self.flush()
        await stop_tasks(self._replay_task)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._ctx = self._pub = self._replay = None

    # --- KvEventSink ---------------------------------------------------------------------
    def stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
        block_size: int, lora_name: str | None,
    ) -> None:  # fmt: skip
        lora_id = None
        if lora_name is not None:  # vLLM numbers adapters from 1 as it first loads them
            lora_id = self._lora_ids.setdefault(lora_name, len(self._lora_ids) + 1)
        self._add(BlockStored(
            block_hashes=[_u64(h) for h in hashes],
            parent_block_hash=None if parent is None else _u64(parent),
            token_ids=list(token_ids),
            block_size=block_size,
            lora_id=lora_id,
            medium=MEDIUM_GPU,
            lora_name=lora_name,
            extra_keys=[(lora_name,)] * len(hashes) if lora_name is not None else None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ))  # fmt: skip

    def removed(self, block_hash: int) -> None:
        self._add(BlockRemoved(block_hashes=[_u64(block_hash)], medium=MEDIUM_GPU, group_idx=0))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    # --- batches -------------------------------------------------------------------------
    def _add(self, event: KVCacheEvent) -> None:
        self._pending.append(event)
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a test driving the pool): flush() by hand
            return
        self._flush_scheduled = True
        loop.call_soon(self.flush)

    def flush(self) -> None:
        """Publish the pending events as one batch."""
        self._flush_scheduled = False
        if not self._pending:
            return
        batch = EventBatch(ts=time.time(), events=self._pending, data_parallel_rank=self._rank)  # type: ignore[arg-type]
        self._pending = []
        payload = encode_batch(batch)
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            # A PUB socket never blocks: past its high-water mark it drops, as vLLM's does; the
            # future is done at once.
            sent = self._pub.send_multipart(
                [self._topic, encode_seq(seq), payload], flags=zmq.NOBLOCK
            )
            error = sent.exception() if isinstance(sent, asyncio.Future) and sent.done() else None
            if error is not None:
                log.warning("sim.kv_publish_failed", seq=seq, error=str(error))

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("sim.kv_replay_bad_request", frames=len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        [client, b"", self._topic, encode_seq(seq), payload]
                    )
            await self._replay.send_multipart([client, b"", b"", END_SEQ, b""])
