"""gateway/accounts/inflight.py: the plain-dict sums routing reads stay equal to local + remote through
every add, done and sync, in any order."""

from __future__ import annotations

import random

from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.accounts.inflight import FRESH_FIELD, PENDING_FIELD, TOKENS_FIELD, SharedInflight


def _expected(local: dict[str, int], remote: dict[str, int]) -> dict[str, int]:
    out = {w: local.get(w, 0) + remote.get(w, 0) for w in local.keys() | remote.keys()}
    return {w: n for w, n in out.items() if n}


def test_totals_follow_adds_dones_and_syncs() -> None:
    rng = random.Random(7)
    inflight = SharedInflight(None, "g1")  # type: ignore[arg-type]  # no sync runs here: no Redis
    live: list[tuple[str, int, int | None, int]] = []
    workers = ["w1", "w2", "w3"]
    for step in range(3000):
        roll = rng.random()
        if roll < 0.45:
            request = (rng.choice(workers), rng.randrange(0, 500), rng.choice([None, 1, 2]), rng.randrange(0, 64))
            inflight.add(*request)
            live.append(request)
        elif roll < 0.9 and live:
            inflight.done(*live.pop(rng.randrange(len(live))))
        else:  # what the other replicas publish (a sync), zeros and vanished workers included
            remote = {w: rng.randrange(0, 3) for w in rng.sample(workers, rng.randrange(0, 4))}
            remote.update({TOKENS_FIELD + w: rng.randrange(0, 900) for w in rng.sample(workers, 2)})
            inflight._set_remote(remote)
        assert inflight.total == _expected(inflight.local, inflight.remote), step
        assert inflight.total_tokens == _expected(inflight.local_tokens, inflight.remote_tokens), step
        for w in workers:
            assert inflight.total.get(w, 0) == inflight.get(w)
            assert inflight.total_tokens.get(w, 0) == inflight.tokens.get(w)
    for request in live:
        inflight.done(*request)
    inflight._set_remote({})
    assert inflight.total == {} and inflight.total_tokens == {}


def _view(worker_id: str, ts: float) -> WorkerView:
    return WorkerView(info=WorkerInfo(id=worker_id, url="http://x", engine="vllm", model="m"), state="ready",
                      load=Load(ts=ts))


def test_fresh_tokens_count_how_kv_changed_since_the_last_engine_report() -> None:
    """`fresh` is what requests took since a worker's last report, less what those that ended
    since freed (whether the report counted them or not): a new report starts it again, it
    may go below zero, and the other replicas' counts add to it."""
    inflight = SharedInflight(None, "g1")  # type: ignore[arg-type]  # no sync runs here: no Redis
    inflight.reported([_view("w1", 1.0), _view("w2", 1.0)])
    inflight.add("w1", 4_000, key=7, prefix=1_500, fresh=100)
    assert inflight.total_fresh == {"w1": 1_600}  # its prefix too: no request there shared it yet
    inflight.add("w1", 4_000, key=7, prefix=1_500, fresh=100)
    assert inflight.total_fresh == {"w1": 1_700}  # the prefix is held already
    inflight.done("w1", 4_000, key=7, prefix=1_500, fresh=100)
    assert inflight.total_fresh == {"w1": 1_600}
    inflight.reported([_view("w1", 2.0), _view("w2", 1.0)])  # w1's engine reported again
    assert inflight.total_fresh == {}
    inflight.done("w1", 4_000, key=7, prefix=1_500, fresh=100)  # the last sharer: its prefix goes too
    assert inflight.total_fresh == {"w1": -1_600}
    inflight.add("w2", 300, fresh=120)
    inflight._set_remote({FRESH_FIELD + "w2": 50, FRESH_FIELD + "w1": 10})
    assert inflight.total_fresh == {"w1": -1_590, "w2": 170}
    inflight.reported([_view("w1", 2.0), _view("w2", 3.0)])
    assert inflight.total_fresh == {"w1": -1_590, "w2": 50}  # the other replica resets its own


def test_pending_prefill_counts_streams_until_their_first_token() -> None:
    """`pending`: the prompt tokens each worker's engine has still to prefill (streams sent whose
    first token has not come); the other replicas' counts add to it, and it never goes below
    zero for a worker."""
    inflight = SharedInflight(None, "g1")  # type: ignore[arg-type]  # no sync runs here: no Redis
    inflight.pend("w1", 3_000)
    inflight.pend("w1", 200)
    inflight.pend("w2", 1_000)
    assert inflight.total_pending == {"w1": 3_200, "w2": 1_000}
    inflight._set_remote({PENDING_FIELD + "w2": 500, PENDING_FIELD + "w3": 40})
    assert inflight.total_pending == {"w1": 3_200, "w2": 1_500, "w3": 40}
    inflight.pend("w1", -3_000)  # its first token came
    inflight.pend("w2", -1_000)
    assert inflight.total_pending == {"w1": 200, "w2": 500, "w3": 40}
    inflight.pend("w1", -500)  # more than it counts: floored at none
    assert inflight.local_pending == {} and inflight.total_pending == {"w2": 500, "w3": 40}
    inflight._set_remote({})
    assert inflight.total_pending == {}
