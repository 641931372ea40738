"""Tenants' pure logic: key records from specs, authentication, settings validation, reset
formatting, usage folding; and the limits failing open when Redis is out of reach."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from fleetgate.keys import Keys
from fleetgate.net import free_port
from fleetgate.registry import connect
from gateway.errors import InvalidRequest, ModelNotAllowed, Unauthorized
from gateway.settings import load_settings
from gateway.tenants.quota import Quota, _cell, _reset
from gateway.tenants.tenants import (
    Directory,
    KeyRecord,
    KeySpec,
    TeamRecord,
    Tenant,
    key_record,
    secret_digest,
    static_key,
)
from gateway.tenants.usage import UsageMetrics, days_back, fold, totals


def test_a_new_key_gets_a_generated_secret_shown_once_and_stored_hashed() -> None:
    record, secret = key_record("alice", KeySpec(rpm=60, team="ml"))
    assert secret is not None and secret.startswith("fg-")
    assert record.secret_sha256 == secret_digest(secret)
    assert secret not in msgspec.json.encode(record).decode()
    assert "secret_sha256" not in record.public()
    # A PUT without a secret keeps the existing one; a given secret replaces it.
    again, shown = key_record("alice", KeySpec(rpm=120), existing=record)
    assert shown is None and again.secret_sha256 == record.secret_sha256 and again.rpm == 120
    _, given = key_record("alice", KeySpec(secret="sk-0123456789abcdef"), existing=record)
    assert given == "sk-0123456789abcdef"


@pytest.mark.parametrize("spec", [KeySpec(rpm=-1), KeySpec(burst_s=0), KeySpec(secret="short"),
                                  KeySpec(secret_sha256="nothex"), KeySpec(secret="a" * 20, secret_sha256="0" * 64)])
def test_bad_key_specs_are_refused(spec: KeySpec) -> None:
    with pytest.raises(InvalidRequest):
        key_record("k", spec)


def test_bad_ids_are_refused() -> None:
    with pytest.raises(InvalidRequest):
        key_record("has space", KeySpec())


def test_directory_authenticates_stored_and_static_keys() -> None:
    stored, secret = key_record("bob", KeySpec(team="ml", models=("m1",)))
    assert secret is not None
    directory = Directory([stored], [TeamRecord(id="ml", rpm=10)], static=["sk-static-key"])
    tenant = directory.authenticate(f"Bearer {secret}")
    assert tenant is not None and tenant.id == "bob" and tenant.team is not None and tenant.limited
    assert tenant.allows("m1") and not tenant.allows("m2")
    static = directory.authenticate("Bearer sk-static-key")
    assert static is not None and static.id == static_key("sk-static-key").id and not static.limited
    assert directory.ids == {"bob", static.id}
    with pytest.raises(Unauthorized):
        directory.authenticate("Bearer wrong")
    assert Directory().authenticate("") is None  # no key at all: the data plane is open


def test_settings_fail_loudly_on_a_mistyped_key_or_limit() -> None:
    with pytest.raises(msgspec.ValidationError, match="rpn"):
        load_settings(None, {"keys": {"k": {"secret": "sk-0123456789abcdef", "rpn": 5}}}, environ={})
    with pytest.raises(msgspec.ValidationError, match=r"keys\.k"):
        load_settings(None, {"keys": {"k": {"secret": "short"}}}, environ={})
    settings = load_settings(None, {"keys": {"k": {"secret": "sk-0123456789abcdef", "rpm": 5}}}, environ={})
    assert "sk-0123456789abcdef" not in str(settings.public())


def test_reset_is_written_the_way_openai_writes_it() -> None:
    assert [_reset(us) for us in (0, 20_000, 1_500_000, 360_000_000)] == ["0ms", "20ms", "1.5s", "6m0s"]


def test_cells_are_rate_and_burst() -> None:
    limits = KeyRecord(id="k", secret_sha256="0" * 64, rpm=120, burst_s=30)
    assert _cell(limits, limits.rpm) == (500_000.0, 60.0)  # 0.5 s a request, 60 at once
    assert _cell(limits, 0) == (0.0, 0.0)


def test_usage_folds_one_days_hash_into_records() -> None:
    rows = {b"a\tm\trequests": b"3", b"a\tm\tinput": b"30", b"a\tm\toutput": b"9", b"b\tm\terrors": b"1",
            b"junk": b"1"}
    records = fold("2026-12-02", rows)
    assert [(r["key"], r["requests"], r["input_tokens"], r["output_tokens"], r["errors"]) for r in records] == [
        ("a", 3, 30, 9, 0), ("b", 0, 0, 0, 1)]
    assert fold("2026-12-02", rows, key="b")[0]["errors"] == 1
    assert totals(records)["input_tokens"] == 30
    assert len(days_back(3)) == 3


def test_limits_fail_open_and_log_once_when_redis_is_away() -> None:
    """A Redis that does not answer (a closed port): requests pass, one warning is logged."""
    async def go() -> None:
        redis = connect(f"redis://127.0.0.1:{free_port()}/0")
        quota = Quota(redis, Keys("x"), UsageMetrics(CollectorRegistry()))
        tenant = Tenant(KeyRecord(id="k", secret_sha256="0" * 64, rpm=1), None)
        with capture_logs() as logs:
            for _ in range(3):
                ticket = await quota.admit(tenant, "m", 10)
                await ticket.settle(10, 5, 200)
        assert [e["event"] for e in logs] == ["gateway.quota_unavailable"]
        with pytest.raises(ModelNotAllowed):
            await quota.admit(Tenant(KeyRecord(id="k", secret_sha256="0" * 64, models=("a",)), None), "m", 1)
        await redis.aclose()

    asyncio.run(go())
