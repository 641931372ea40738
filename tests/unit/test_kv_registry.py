"""Workers' prefix-cache indexes in Redis (fleetgate/kv_registry.py): the agent's writer and
a gateway's mirror, against a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from fleetgate.connection import connect
from fleetgate.keys import Keys
from fleetgate.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from fleetgate.kv_index import BlockIndex, chain_keys
from fleetgate.kv_registry import KvIndexWriter, KvMirror

PROMPT = list(range(50, 66))
KEYS = chain_keys(PROMPT, 4)


@dataclass
class Health:
    state: str = "events"
    reason: str = ""


@pytest.fixture
async def redis(redis_url: str, prefix: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url)
    yield client
    keys = [k async for k in client.scan_iter(match=f"{{{prefix}}}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


def store(index: BlockIndex, first: int, last: int) -> None:
    """Blocks first..last of PROMPT (engine hashes 100 + n)."""
    index.apply(EventBatch(ts=0.0, events=[BlockStored(
        block_hashes=[100 + n for n in range(first, last + 1)],
        parent_block_hash=None if first == 0 else 100 + first - 1,
        token_ids=PROMPT[first * 4 : (last + 1) * 4], block_size=4, lora_id=None, medium="GPU",
        lora_name=None, group_idx=0,
    )]))  # fmt: skip


def evict(index: BlockIndex, n: int) -> None:
    index.apply(EventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[100 + n], medium="GPU")]))


async def test_a_gateway_mirrors_the_index_change_by_change(redis: aioredis.Redis, prefix: str) -> None:
    """Stored and evicted blocks reach the mirror; a prompt's cached prefix is counted from it."""
    index, health = BlockIndex(), Health()
    writer = KvIndexWriter(redis, "w1", index, health, prefix=prefix)
    mirror = KvMirror(prefix)
    await writer.flush()
    await mirror.refresh(redis, ["w1"])
    wkv = mirror.get("w1")
    assert wkv is not None and wkv.cached_blocks(KEYS) == 0
    store(index, 0, 3)
    await writer.flush()
    await mirror.refresh(redis, ["w1"])
    assert wkv.cached_blocks(KEYS) == 4 and wkv.block_size == 4
    evict(index, 3)
    evict(index, 2)
    await writer.flush()
    await mirror.refresh(redis, ["w1"])
    assert wkv.cached_blocks(KEYS) == 2 and len(wkv.keys) == 2


async def test_a_gateway_that_starts_later_loads_the_snapshot_then_follows(redis: aioredis.Redis, prefix: str) -> None:
    """The index does not depend on a gateway having watched from the start."""
    index = BlockIndex()
    writer = KvIndexWriter(redis, "w1", index, Health(), prefix=prefix)
    store(index, 0, 1)
    await writer.flush()
    for n in (2, 3):
        store(index, n, n)
        await writer.flush()
    mirror = KvMirror(prefix)
    await mirror.refresh(redis, ["w1"])  # snapshot (version 1) ...
    await mirror.refresh(redis, ["w1"])  # ... and the entries after it
    wkv = mirror.get("w1")
    assert wkv is not None and wkv.cached_blocks(KEYS) == 4 and wkv.version == writer.version


async def test_a_restarted_agent_is_a_new_generation(redis: aioredis.Redis, prefix: str) -> None:
    """A new writer (agent restart) starts from a fresh snapshot; mirrors notice the new
    generation and reload instead of applying its entries to the old set."""
    index = BlockIndex()
    first = KvIndexWriter(redis, "w1", index, Health(), prefix=prefix)
    store(index, 0, 3)
    await first.flush()
    mirror = KvMirror(prefix)
    await mirror.refresh(redis, ["w1"])
    index2 = BlockIndex()
    second = KvIndexWriter(redis, "w1", index2, Health(), prefix=prefix)
    store(index2, 0, 0)
    await second.flush()
    assert second.gen > first.gen
    await mirror.refresh(redis, ["w1"])  # sees another generation: reloads
    await mirror.refresh(redis, ["w1"])
    wkv = mirror.get("w1")
    assert wkv is not None and wkv.gen == second.gen and wkv.cached_blocks(KEYS) == 1


async def test_lost_events_reach_the_gateway_and_it_falls_back(redis: aioredis.Redis, prefix: str) -> None:
    """When the subscriber says "lost", get() answers None (use approximate placement) and
    status() says why."""
    index, health = BlockIndex(), Health()
    writer = KvIndexWriter(redis, "w1", index, health, prefix=prefix)
    store(index, 0, 1)
    await writer.flush()
    mirror = KvMirror(prefix)
    await mirror.refresh(redis, ["w1"])
    assert mirror.get("w1") is not None
    health.state, health.reason = "lost", "publisher disconnected"
    index.apply(EventBatch(ts=0.0, events=[AllBlocksCleared()]))
    await writer.flush()
    await mirror.refresh(redis, ["w1"])
    status = mirror.status("w1")
    assert mirror.get("w1") is None
    assert status is not None and status.reason == "publisher disconnected" and not status.keys


async def test_workers_without_events_have_no_index(redis: aioredis.Redis, prefix: str) -> None:
    """An LMDeploy or ms-swift worker writes nothing: the mirror has nothing for it, and a
    worker that left the registry is forgotten."""
    index = BlockIndex()
    await KvIndexWriter(redis, "w1", index, Health(), prefix=prefix).flush()
    mirror = KvMirror(prefix)
    await mirror.refresh(redis, ["w1", "lmdeploy-1"])
    assert mirror.get("lmdeploy-1") is None and mirror.get("w1") is not None
    await mirror.refresh(redis, ["lmdeploy-1"])
    assert mirror.status("w1") is None


async def test_a_lost_snapshot_starts_a_new_generation(redis: aioredis.Redis, prefix: str) -> None:
    """Redis restarted empty: the writer's next write notices and rewrites everything."""
    index = BlockIndex()
    writer = KvIndexWriter(redis, "w1", index, Health(), prefix=prefix)
    store(index, 0, 1)
    await writer.flush()
    await redis.delete(Keys(prefix).kv_snapshot("w1"), Keys(prefix).kv("w1"))
    store(index, 2, 2)
    await writer.flush()  # writes an entry, sees the snapshot gone
    await writer.flush()  # a new generation with the whole index
    mirror = KvMirror(prefix)
    await mirror.refresh(redis, ["w1"])
    wkv = mirror.get("w1")
    assert wkv is not None and wkv.cached_blocks(KEYS) == 3
