"""The Redis registry against a real Redis: records, TTL, drain flag, events, pruning."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from fleetgate.registry import Keys, Registry, connect
from fleetgate.schema import Load, WorkerInfo


@pytest.fixture
async def registry(redis_url: str, prefix: str) -> AsyncIterator[Registry]:
    redis = connect(redis_url)
    reg = Registry(redis, prefix, heartbeat_ttl_s=0.6)
    yield reg
    keys = [k async for k in redis.scan_iter(match=f"{{{prefix}}}:*")]
    if keys:
        await redis.delete(*keys)
    await redis.aclose()


def info(worker_id: str = "w1", **kw: object) -> WorkerInfo:
    fields: dict[str, object] = {"id": worker_id, "url": "http://127.0.0.1:9", "engine": "sim", "model": "m"}
    fields.update(kw)
    return msgspec.convert(fields, WorkerInfo)


async def test_register_then_read_round_trips_record_state_and_load(registry: Registry) -> None:
    """What an agent registers is what a reader gets back, typed."""
    await registry.register(info(adapters=("a", "b"), max_model_len=8192), "ready", Load(running=3, waiting=1))
    [view] = await registry.read_all()
    assert view.info.adapters == ("a", "b")
    assert view.info.max_model_len == 8192
    assert view.state == "ready"
    assert (view.load.running, view.load.waiting) == (3, 1)
    assert view.routable and not view.draining


async def test_record_expires_without_heartbeats_and_index_is_pruned(registry: Registry) -> None:
    """A worker whose agent stops heartbeating vanishes after the TTL; readers drop its id."""
    await registry.register(info(), "ready")
    assert await registry.heartbeat("w1", Load(running=1)) == "ok"
    await asyncio.sleep(0.35)
    assert await registry.heartbeat("w1", Load(running=2)) == "ok"  # refreshes the TTL
    await asyncio.sleep(0.35)
    assert [v.id for v in await registry.read_all()] == ["w1"]
    await asyncio.sleep(0.8)
    assert await registry.read_all() == []
    assert await registry.redis.scard(registry.keys.workers) == 0


async def test_a_record_registered_again_while_a_reader_prunes_it_stays_indexed(
    registry: Registry, redis_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader that found a record expired (a failover outlasted its TTL) prunes its id only
    if it is still gone: an agent that registered again in between, its heartbeats answered
    "ok" from then on (so it never registers again), stays in the index and in the fleet."""
    await registry.register(info(), "ready")
    await registry.redis.delete(registry.keys.worker("w1"))  # expired on the promoted replica
    agent_redis = connect(redis_url)
    agent = Registry(agent_redis, prefix, heartbeat_ttl_s=5)
    real_pipeline = registry.redis.pipeline

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        # The reader's round trip has found the record gone; the agent registers it again
        # before the reader prunes (the gap is wide on a loaded machine).
        pipe = real_pipeline(*args, **kwargs)
        execute = pipe.execute

        async def execute_then_register(*a: Any, **kw: Any) -> Any:
            rows = await execute(*a, **kw)
            monkeypatch.setattr(registry.redis, "pipeline", real_pipeline)  # once
            await agent.register(info(), "ready")
            return rows

        monkeypatch.setattr(pipe, "execute", execute_then_register)
        return pipe

    monkeypatch.setattr(registry.redis, "pipeline", pipeline)
    try:
        assert await registry.read_all() == []  # it read the record gone
        assert await agent.heartbeat("w1", Load()) == "ok"  # so the agent registers no more
        assert [v.id for v in await registry.read_all()] == ["w1"]
    finally:
        await agent_redis.aclose()


async def test_heartbeat_after_expiry_reports_missing_and_does_not_recreate(registry: Registry) -> None:
    """A heartbeat never resurrects a partial record: the agent is told to register again."""
    await registry.register(info(), "ready")
    await registry.redis.delete(registry.keys.worker("w1"))  # as after a Redis restart
    assert await registry.heartbeat("w1", Load()) == "missing"
    assert not await registry.redis.exists(registry.keys.worker("w1"))


async def test_admin_drain_survives_agent_rewrites(registry: Registry) -> None:
    """An operator's drain is a separate field: the agent re-registering info keeps it."""
    await registry.register(info(), "ready")
    assert await registry.set_admin_drain("w1", True)
    await registry.update_info(info(adapters=("x",)))
    await registry.heartbeat("w1", Load())
    [view] = await registry.read_all()
    assert view.admin_drain and view.draining and not view.routable
    assert view.effective_state == "draining"
    assert await registry.set_admin_drain("w1", False)
    [view] = await registry.read_all()
    assert view.routable


async def test_admin_writes_to_unknown_worker_report_not_found(registry: Registry) -> None:
    """Draining or removing a worker that is not registered says so and writes nothing."""
    assert not await registry.set_admin_drain("ghost", True)
    assert not await registry.deregister("ghost")
    assert not await registry.redis.exists(registry.keys.worker("ghost"))


async def test_changes_are_published_on_the_events_channel(registry: Registry) -> None:
    """Register, state change, drain and removal each publish the worker's id."""
    pubsub = await registry.subscribe()
    await registry.register(info(), "starting")
    await registry.set_state("w1", "ready")
    await registry.set_admin_drain("w1", True)
    await registry.deregister("w1")
    seen = []
    deadline = asyncio.get_running_loop().time() + 3
    while len(seen) < 4 and asyncio.get_running_loop().time() < deadline:
        message = await pubsub.get_message(timeout=0.5)
        if message is not None:
            seen.append(message["data"])
    assert seen == [b"w1"] * 4
    await pubsub.aclose()


async def test_records_of_another_schema_version_are_skipped(registry: Registry) -> None:
    """A reader ignores records written by a different schema version."""
    await registry.register(info("new"), "ready")
    key = registry.keys.worker("old")
    await registry.redis.hset(key, mapping={"info": b'{"id":"old","url":"u","engine":"e","model":"m","schema":99}', "state": "ready"})
    await registry.redis.sadd(registry.keys.workers, "old")
    assert [v.id for v in await registry.read_all()] == ["new"]


def test_keys_share_one_cluster_slot() -> None:
    """Every key carries the same hash tag, so pipelines and scripts work on Redis Cluster."""
    keys = Keys("fleet")
    for key in (keys.workers, keys.events, keys.worker("a"), keys.worker("b")):
        assert key.startswith("{fleet}:v1:")


async def test_inflight_counts_are_summed_across_gateways_and_expire_with_the_lease(registry: Registry) -> None:
    """Each gateway publishes its in-flight counts under a lease; readers sum the live ones."""
    await registry.publish_inflight("gw1", {"w1": 2, "w2": 1}, lease_s=0.5)
    await registry.publish_inflight("gw2", {"w1": 3, "w3": 0}, lease_s=5)
    assert await registry.read_inflight() == {"w1": 5, "w2": 1}
    assert await registry.read_inflight(exclude_gateway="gw2") == {"w1": 2, "w2": 1}
    await registry.publish_inflight("gw2", {}, lease_s=5)  # its requests finished
    assert await registry.read_inflight() == {"w1": 2, "w2": 1}
    await asyncio.sleep(0.7)  # gw1 crashed: its lease runs out, its counts go with it
    assert await registry.read_inflight() == {}
    members = await registry.redis.smembers(registry.keys.gateways)
    assert members == {b"gw2"}


async def test_stop_request_drains_and_tells_the_agent_on_its_next_heartbeat(registry: Registry) -> None:
    """drain?stop=true marks the worker drained at once and answers the agent's heartbeat with stop."""
    await registry.register(info(), "ready")
    assert await registry.request_stop("w1")
    [view] = await registry.read_all()
    assert view.draining
    assert await registry.heartbeat("w1", Load()) == "stop"


async def test_with_a_registration_secret_only_signed_records_are_read(redis_url: str, prefix: str) -> None:
    """A registration secret: records written without it (or with another) are never routed to."""
    redis = connect(redis_url)
    genuine = Registry(redis, prefix, secret="s3cret")
    forged = Registry(redis, prefix, secret="")
    other = Registry(redis, prefix, secret="guess")
    await genuine.register(info("real"), "ready")
    await forged.register(info("fake", url="http://169.254.169.254"), "ready")
    await other.register(info("wrong-key"), "ready")
    assert [v.id for v in await genuine.read_all()] == ["real"]
    await genuine.update_info(info("real", adapters=("x",)))
    [view] = await genuine.read_all()
    assert view.info.adapters == ("x",)
    keys = [k async for k in redis.scan_iter(match=f"{{{prefix}}}:*")]
    await redis.delete(*keys)
    await redis.aclose()


async def test_heartbeat_tells_the_agent_of_a_drain_which_it_can_reassert(registry: Registry) -> None:
    """The agent learns of an operator's drain from its heartbeat, and after Redis lost the
    record (a restart) it registers the worker drained again."""
    await registry.register(info(), "ready")
    assert await registry.heartbeat("w1", Load()) == "ok"
    assert await registry.set_admin_drain("w1", True)
    assert await registry.heartbeat("w1", Load()) == "drained"
    await registry.redis.delete(registry.keys.worker("w1"))  # as after a Redis restart
    await registry.register(info(), "ready", admin_drain=True)
    [view] = await registry.read_all()
    assert view.admin_drain and not view.routable and view.effective_state == "draining"
    assert await registry.set_admin_drain("w1", False)
    assert await registry.heartbeat("w1", Load()) == "ok"


async def test_an_unhealthy_heartbeat_takes_the_worker_out_of_routing_at_once(registry: Registry) -> None:
    """A heartbeat whose load says unhealthy makes the worker unroutable, and with `announce`
    every reader hears of it; a healthy one puts it back."""
    await registry.register(info(), "ready")
    pubsub = await registry.subscribe()
    assert await registry.heartbeat("w1", Load(unhealthy="3 probes failed in a row"), announce=True) == "ok"
    message = None
    deadline = asyncio.get_running_loop().time() + 3
    while message is None and asyncio.get_running_loop().time() < deadline:
        message = await pubsub.get_message(timeout=0.5)
    await pubsub.aclose()
    assert message is not None and message["data"] == b"w1"
    [view] = await registry.read_all()
    assert view.unhealthy and not view.routable and view.effective_state == "unhealthy"
    await registry.heartbeat("w1", Load())
    [view] = await registry.read_all()
    assert view.routable and view.effective_state == "ready"


async def test_lora_counts_are_shared_under_a_lease_and_the_lru_never_goes_back(registry: Registry) -> None:
    """Per-(worker, adapter) in-flight counts of one gateway are read by another (not by itself),
    vanish with the lease; last-used times only move forward."""
    await registry.publish_inflight("g1", {}, lease_s=0.3)  # lists g1 among the gateways
    await registry.publish_lora("g1", {("w1", "fin"): 2, ("w1", "law"): 0}, {("w1", "fin"): 100.0}, lease_s=0.3)
    assert await registry.read_lora(exclude_gateway="g2") == {("w1", "fin"): 2}
    assert await registry.read_lora(exclude_gateway="g1") == {}
    await registry.publish_lora("g1", {}, {("w1", "fin"): 50.0, ("w1", "law"): 70.0}, lease_s=0.3)
    assert await registry.read_lora_used(["w1"]) == {("w1", "fin"): 100.0, ("w1", "law"): 70.0}
    await asyncio.sleep(0.4)
    assert await registry.read_lora(exclude_gateway="g2") == {}


async def test_adapter_lock_is_one_holder_at_a_time_and_only_the_holder_unlocks(registry: Registry) -> None:
    assert await registry.lock_adapter("fin", "g1", 5)
    assert not await registry.lock_adapter("fin", "g2", 5)
    await registry.unlock_adapter("fin", "g2")  # not the holder: no effect
    assert not await registry.lock_adapter("fin", "g2", 5)
    await registry.unlock_adapter("fin", "g1")
    assert await registry.lock_adapter("fin", "g2", 5)


async def test_admin_added_adapters_are_kept(registry: Registry) -> None:
    await registry.save_adapter("extra", b'{"path":"/a/extra","base":"m"}')
    assert await registry.read_adapters() == {"extra": b'{"path":"/a/extra","base":"m"}'}
