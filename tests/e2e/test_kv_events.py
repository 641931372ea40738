"""KV cache events end to end: the simulator's ZMQ publisher in a process of its own, the
agent's subscriber and Redis writer, and a gateway's mirror, over loopback and a real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

from fleetgate.connection import connect
from fleetgate.kv_index import BlockIndex, chain_keys
from fleetgate.kv_registry import KvIndexWriter, KvMirror
from fleetgate.net import free_port
from tests.conftest import ROOT, until
from workers.kv_events import KvEventSubscriber

BS = 16
PROMPT = list(range(1000, 1064))  # four blocks
KEYS = chain_keys(PROMPT, BS)

# The engine side: the simulator's block pool and publisher, driven line by line from stdin
# the way the scheduler drives them (admit a prompt, cache its blocks, finish, and take every
# block for new work, which evicts the cached ones, tail first).
ENGINE = """
import asyncio, sys
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from workers.simulator.kv_events import KvEventsConfig, SimKvPublisher
from workers.simulator.kvcache import BlockPool, block_hashes

async def main(pub_port, replay_port):
    pub = SimKvPublisher(KvEventsConfig(enable_kv_cache_events=True, topic="kv",
        endpoint=f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}"))
    pub.start()
    pool = BlockPool(6, events=pub)
    prompt = list(range(1000, 1064))
    hashes = block_hashes(prompt, 16, "")
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        if line == "serve":
            held = pool.lookup(hashes, 4)
            pool.touch(held)
            blocks = held + pool.allocate(4 - len(held))
            pool.cache_full_blocks(blocks, hashes, len(held), 4, prompt, 16)
            pool.release(blocks)
        elif line == "fill":
            pool.release(pool.allocate(pool.num_free))
        await asyncio.sleep(0)  # the step's batch goes out
        print("ok", pub.next_seq, flush=True)

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


class Engine:
    def __init__(self, pub_port: int, replay_port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, str(pub_port), str(replay_port)], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.readline() == "ready"

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    async def do(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return await asyncio.to_thread(self.readline)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)



@contextlib.asynccontextmanager
async def running(*coros: object) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(c) for c in coros]  # type: ignore[arg-type]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def test_events_reach_a_gateway_and_a_killed_engine_falls_back(redis_url: str, prefix: str) -> None:
    """Blocks the engine caches show up in a gateway's mirror under the prompt's chain keys,
    evicted ones leave it, and a SIGKILLed engine is "lost" (fall back) within about a second."""
    pub_port, replay_port = free_port(), free_port()
    engine = Engine(pub_port, replay_port)
    redis = connect(redis_url)
    index = BlockIndex()
    sub = KvEventSubscriber(f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                            topic="kv", index=index, name="w1")  # fmt: skip
    writer = KvIndexWriter(redis, "w1", index, sub, prefix=prefix)
    mirror = KvMirror(prefix)

    async def refresh() -> None:
        while True:
            await mirror.refresh(redis, ["w1"])
            await asyncio.sleep(0.05)

    def cached() -> int:
        wkv = mirror.get("w1")
        return wkv.cached_blocks(KEYS) if wkv is not None else -1

    try:
        async with running(sub.run(), writer.run(0.05), refresh()):
            assert (await engine.do("serve")).startswith("ok")
            await until(lambda: cached() == 4)
            await engine.do("serve")  # all four hit: nothing new is stored
            await engine.do("fill")  # needs 6 free blocks: evicts all four cached ones
            await until(lambda: cached() == 0)
            assert sub.state == "events" and sub.next_seq == 2

            engine.kill()
            lost_after = await until(lambda: sub.state == "lost")
            mirror_after = await until(lambda: mirror.get("w1") is None)
            assert sub.reason == "publisher disconnected"
            status = mirror.status("w1")
            assert status is not None and status.reason == "publisher disconnected"
            assert lost_after < 1.0 and mirror_after < 1.5
    finally:
        if engine.proc.poll() is None:
            engine.kill()
        keys = [k async for k in redis.scan_iter(match=f"{{{prefix}}}:*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
