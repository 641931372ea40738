"""gateway/inflight.py: the plain-dict sums routing reads stay equal to local + remote through
every add, done and sync, in any order."""

from __future__ import annotations

import random

from gateway.inflight import TOKENS_FIELD, SharedInflight


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
