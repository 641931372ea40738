"""The agent's KV event subscriber (workers/kv_events.py) against a scripted vLLM-like
publisher over loopback ZMQ: replay of history and gaps, and falling back when it can't."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from fleetgate.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_seq,
)
from fleetgate.kv_index import chain_keys
from fleetgate.net import free_port
from tests.conftest import until
from workers.kv_events import KvEventSubscriber

TOPIC = b"kv"


class FakeEngine:
    """vLLM's ZmqEventPublisher, scripted: batches can be buffered without being sent (a PUB
    message lost), the replay socket can stop answering (a hung engine)."""

    def __init__(self, pub_port: int, replay_port: int, buffer_steps: int = 10_000, bind: bool = True) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if bind:
            self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        else:
            self.pub.connect(f"tcp://127.0.0.1:{pub_port}")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replays = 0
        # (n, event): a replay holds after its n-th batch (before the end marker if it has n),
        # until the event is set.
        self.pause: tuple[int, asyncio.Event] | None = None
        self.task: asyncio.Task[None] | None = asyncio.create_task(self._serve())

    async def publish(self, *events: object, send: bool = True) -> None:
        payload = encode_batch(EventBatch(ts=time.time(), events=list(events), data_parallel_rank=0))  # type: ignore[arg-type]
        self.buffer.append((self.seq, payload))
        if send:
            await self.pub.send_multipart([TOPIC, encode_seq(self.seq), payload])
        self.seq += 1

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replays += 1
            sent = 0
            for seq, payload in list(self.buffer):
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", TOPIC, encode_seq(seq), payload])
                    sent += 1
                    if self.pause is not None and sent == self.pause[0]:
                        await self.pause[1].wait()
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def hang(self) -> None:
        """Stop answering replays; the sockets stay open."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def close(self) -> None:
        await self.hang()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.ctx.term()


def block(n: int, parent: int | None = None) -> BlockStored:
    """Block n of a prompt whose block i holds tokens [4i, 4i + 4)."""
    return BlockStored(block_hashes=[1000 + n], parent_block_hash=parent, token_ids=list(range(4 * n, 4 * n + 4)),
                       block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0)  # fmt: skip


KEYS = chain_keys(list(range(24)), 4)



@pytest.fixture
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@contextlib.asynccontextmanager
async def subscribed(sub: KvEventSubscriber) -> AsyncIterator[KvEventSubscriber]:
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def subscriber(ports: tuple[int, int], **kw: object) -> KvEventSubscriber:
    return KvEventSubscriber(f"tcp://127.0.0.1:{ports[0]}", replay_endpoint=f"tcp://127.0.0.1:{ports[1]}",
                             topic="kv", **kw)  # type: ignore[arg-type]  # fmt: skip


async def test_history_published_before_we_joined_is_replayed(ports: tuple[int, int]) -> None:
    """Joining a running engine, the subscriber replays from seq 0 and is then "events"."""
    engine = FakeEngine(*ports)
    try:
        await engine.publish(block(0))
        await engine.publish(block(1, 1000))
        async with subscribed(subscriber(ports)) as sub:
            await until(lambda: sub.state == "events")
            assert sub.next_seq == 2 and all(k in sub.index for k in KEYS[:2])
            await engine.publish(block(2, 1001))
            await until(lambda: KEYS[2] in sub.index)
    finally:
        await engine.close()


async def test_a_partial_replay_is_not_trusted_until_its_end(ports: tuple[int, int]) -> None:
    """The replay's first batch is in, the rest held back (a busy engine, a loaded host): the
    index is partial, so the state is not "events" until the end marker."""
    engine = FakeEngine(*ports)
    engine.pause = (1, release := asyncio.Event())
    try:
        await engine.publish(block(0))
        await engine.publish(block(1, 1000))
        async with subscribed(subscriber(ports, replay_timeout_s=30.0, silence_s=30.0)) as sub:
            await until(lambda: sub.next_seq == 1)  # the first batch applied, the second held
            assert sub.state == "lost" and sub.reason == "replaying the engine's history"
            release.set()
            await until(lambda: sub.state == "events")
            assert sub.next_seq == 2 and all(k in sub.index for k in KEYS[:2])
    finally:
        await engine.close()


async def test_a_lost_batch_is_replayed_when_the_next_one_shows_the_gap(ports: tuple[int, int]) -> None:
    """A batch the PUB socket lost is fetched from the replay buffer; the state never leaves
    "events"."""
    engine = FakeEngine(*ports)
    try:
        async with subscribed(subscriber(ports, probe_every_s=30.0)) as sub:
            await until(lambda: sub.state == "events")
            await engine.publish(block(0))
            await engine.publish(block(1, 1000), send=False)
            await engine.publish(block(2, 1001))
            await until(lambda: sub.next_seq == 3)
            assert all(k in sub.index for k in KEYS[:3]) and sub.state == "events"
    finally:
        await engine.close()


async def test_a_lost_last_batch_is_found_by_the_idle_probe(ports: tuple[int, int]) -> None:
    """No later batch reveals a lost last one: the probe of the replay socket brings it."""
    engine = FakeEngine(*ports)
    try:
        async with subscribed(subscriber(ports, probe_every_s=0.1)) as sub:
            await until(lambda: sub.state == "events")
            await engine.publish(block(0), send=False)
            await until(lambda: KEYS[0] in sub.index)
    finally:
        await engine.close()


async def test_a_gap_older_than_the_buffer_is_lost_until_a_clear(ports: tuple[int, int]) -> None:
    """History the replay buffer no longer holds cannot be rebuilt: "lost" with the reason,
    until an AllBlocksCleared makes the index whole again."""
    engine = FakeEngine(*ports, buffer_steps=2)
    engine.pause = (2, release := asyncio.Event())  # the replay's end marker held back at first
    try:
        for n in range(4):
            await engine.publish(block(n, 1000 + n - 1 if n else None))
        async with subscribed(subscriber(ports, replay_timeout_s=30.0, silence_s=30.0)) as sub:
            await until(lambda: sub.next_seq == 4)  # both batches the buffer holds, not yet its end
            assert sub.state == "lost" and "gone from the replay buffer" in sub.reason
            release.set()
            await engine.publish(AllBlocksCleared(), block(0))
            await until(lambda: sub.state == "events")
            assert len(sub.index) == 1
    finally:
        await engine.close()


async def test_a_hung_publisher_is_lost_within_a_second(ports: tuple[int, int]) -> None:
    """Connected but answering nothing (an idle engine publishes nothing, so the probe is
    what tells): "lost" about one second after its last answer."""
    engine = FakeEngine(*ports)
    try:
        async with subscribed(subscriber(ports, silence_s=1.0)) as sub:
            await until(lambda: sub.state == "events")
            await engine.hang()
            took = await until(lambda: sub.state == "lost")
            assert "silent" in sub.reason
            assert took < 2.0
    finally:
        await engine.close()


async def test_a_dead_publisher_is_lost_at_once_and_a_new_one_resyncs(ports: tuple[int, int]) -> None:
    """A dropped connection is the engine gone: "lost" and the index emptied at once; an
    engine started on the same ports (seq from 0 again) is replayed from scratch."""
    engine = FakeEngine(*ports)
    async with subscribed(subscriber(ports)) as sub:
        try:
            await engine.publish(block(0))
            await until(lambda: sub.state == "events" and len(sub.index) == 1)
        finally:
            await engine.close()
        took = await until(lambda: sub.state == "lost")
        assert sub.reason == "publisher disconnected" and len(sub.index) == 0
        assert took < 1.0
        engine = FakeEngine(*ports)
        try:
            await engine.publish(block(1, None))
            await until(lambda: sub.state == "events" and sub.next_seq == 1)
            assert len(sub.index) == 1 and KEYS[0] not in sub.index
        finally:
            await engine.close()


async def test_we_can_bind_and_let_the_engine_connect(ports: tuple[int, int]) -> None:
    """vLLM connects its PUB socket to an endpoint without a wildcard: the agent binds it on
    loopback, and the engine's connection closing is "lost" as well."""
    async with subscribed(subscriber(ports, bind=True)) as sub:
        engine = FakeEngine(*ports, bind=False)
        try:
            await until(lambda: sub.state == "events")
            await engine.publish(block(0))
            await until(lambda: KEYS[0] in sub.index)
        finally:
            await engine.close()
        took = await until(lambda: sub.state == "lost")
        assert sub.reason == "publisher disconnected" and took < 1.0


async def test_without_a_replay_endpoint_joining_late_is_lost(ports: tuple[int, int]) -> None:
    """With no replay socket, history before the first batch seen is unknown."""
    engine = FakeEngine(*ports)
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{ports[0]}", topic="kv")
    try:
        await engine.publish(block(0))
        async with subscribed(sub):
            await until(lambda: sub.connected)
            deadline = time.monotonic() + 10
            while sub.next_seq == 0 and time.monotonic() < deadline:  # until the subscription is in
                await engine.publish(block(1, 1000))
                await asyncio.sleep(0.05)
            assert sub.state == "lost" and "no replay endpoint" in sub.reason
    finally:
        await engine.close()
