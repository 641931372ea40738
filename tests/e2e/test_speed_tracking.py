"""Worker speed measured while the engines serve (issue 37), on real processes: a gateway and
two simulated workers of the same card under a steady load; one is slowed to half speed
mid-run (the simulator's `slow` fault, its profile unchanged) and later restored. The
gateway's view (its `fleetgate_worker_speed` gauge, what its routing snapshot holds) must
follow within 10 s each way, and the traffic split with it."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Fleet, wait_until

MODEL = "demo-model"
# An L40S at half time: steps of ~19 ms, well above the event loop's jitter on a busy
# 2-core machine, so the measured step times are the simulated ones.
CARD = ("--model", MODEL, "--sim-profile", "l40s-7b", "--option", "time_scale=0.5")
CLIENTS = 6
# The bound for seeing a slowed (or restored) worker; the waits below allow more so
# that a miss reports how long it took.
WITHIN_S = 10.0


def gateway_speeds(url: str) -> dict[str, tuple[float, str]]:
    """worker -> (speed, source) as this gateway's routing snapshot holds them."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out: dict[str, tuple[float, str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "fleetgate_worker_speed":
            for sample in family.samples:
                out[sample.labels["worker"]] = (sample.value, sample.labels["source"])
    return out


class Load:
    """CLIENTS closed-loop clients sending distinct chat requests through the gateway; each
    answer's worker is recorded with the time its request was sent."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.sent: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _client(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                body = {"model": MODEL, "max_tokens": 24, "ignore_eos": True, "messages": [
                    {"role": "user", "content": f"Ticket {uuid.uuid4().hex} from client {index}: summarise it."}]}
                r = client.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    self.sent.append((started, r.headers["x-fleetgate-worker"]))
                else:
                    self.errors.append(f"{r.status_code} {r.text[:200]}")

    def share(self, worker: str, since: float, until: float) -> tuple[float, int]:
        """`worker`'s share of the requests sent in [since, until), and how many there were."""
        picked = [w for t, w in list(self.sent) if since <= t < until]
        return (picked.count(worker) / len(picked) if picked else 0.0), len(picked)


@contextmanager
def steady_load(url: str) -> Iterator[Load]:
    load = Load(url)
    for t in load.threads:
        t.start()
    try:
        yield load
    finally:
        load.stop.set()
        for t in load.threads:
            t.join(timeout=60)


def ratio_of(url: str, slowed: str, steady: str) -> float:
    speeds = gateway_speeds(url)
    return speeds[slowed][0] / speeds[steady][0]


def wait_for_ratio(url: str, slowed: str, steady: str, low: float, high: float, timeout: float) -> float:
    """Seconds until the gateway weighs `slowed` at low..high of `steady` (the last ratio on a miss)."""
    started = time.monotonic()
    seen: list[float] = []

    def inside() -> bool:
        seen.append(round(ratio_of(url, slowed, steady), 3))
        return low <= seen[-1] <= high

    try:
        wait_until(inside, timeout=timeout, interval=0.25)
    except AssertionError:
        raise AssertionError(f"not within {low}..{high} in {timeout} s: {seen[-12:]}") from None
    return time.monotonic() - started


def test_a_worker_slowed_mid_run_is_weighed_and_loaded_at_its_new_speed(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """Two workers of one simulated card serve a steady load and measure the same speed from
    their engines' counters. One is slowed to half speed: within 10 s the gateway weighs it
    at 0.45-0.55 of the other and sends it about a third of the new requests (its share of
    the fleet's capacity), not half. Restored, it is weighed as the other within 10 s and
    gets its half again."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    fleet.worker("steady", *CARD)
    fleet.worker("slowed", *CARD)
    fleet.wait_ready(url, "steady", "slowed")
    engine_url = str(fleet.workers(url)["slowed"]["url"])
    with steady_load(url) as load:
        # Both measured from their engines (not the profile's figure), and alike.
        def both_measured() -> bool:
            speeds = gateway_speeds(url)
            return all(speeds.get(w, (0.0, ""))[1] == "engine" for w in ("steady", "slowed"))

        wait_until(both_measured, timeout=60, interval=0.25)
        wait_for_ratio(url, "slowed", "steady", 0.9, 1.1, timeout=30)
        before = time.monotonic()
        wait_until(lambda: load.share("slowed", before, time.monotonic())[1] >= 60, timeout=60, interval=0.25)
        even, n_even = load.share("slowed", before, time.monotonic())
        assert 0.35 <= even <= 0.65, (even, n_even)

        assert httpx.post(f"{engine_url}/sim/faults", json={"slow": 2}, timeout=5).status_code == 200
        took_slow = wait_for_ratio(url, "slowed", "steady", 0.45, 0.55, timeout=3 * WITHIN_S)
        # Traffic follows the weights: new requests go where placed work per unit of
        # capacity x speed is least, so the slowed worker gets ~1/3 of them.
        # 240 requests: the share of 120 moved by +-0.04 between runs (0.37-0.425), the width
        # of the margin to the bound.
        since = time.monotonic() + 1.0
        wait_until(lambda: load.share("slowed", since, time.monotonic())[1] >= 240, timeout=90, interval=0.25)
        slow_share, n_slow = load.share("slowed", since, time.monotonic())
        halfway = ratio_of(url, "slowed", "steady")

        assert httpx.post(f"{engine_url}/sim/faults", json={"slow": None}, timeout=5).status_code == 200
        took_back = wait_for_ratio(url, "slowed", "steady", 0.9, 1.1, timeout=3 * WITHIN_S)
        since = time.monotonic() + 1.0
        wait_until(lambda: load.share("slowed", since, time.monotonic())[1] >= 60, timeout=60, interval=0.25)
        back_share, n_back = load.share("slowed", since, time.monotonic())
    print(f"speed tracking: halved seen in {took_slow:.1f} s (ratio {halfway:.3f}), restored seen in "
          f"{took_back:.1f} s; slowed worker's share {even:.2f} (n={n_even}) -> {slow_share:.2f} (n={n_slow}) "
          f"-> {back_share:.2f} (n={n_back})")
    assert not load.errors, load.errors[:3]
    assert took_slow <= WITHIN_S and took_back <= WITHIN_S, (took_slow, took_back)
    assert 0.45 <= halfway <= 0.55, halfway
    assert 0.2 <= slow_share <= 0.42, (slow_share, n_slow)
    assert back_share >= 0.4, (back_share, n_back)
    # The start-up figure (the profile's) is what each registered, and stays as registered.
    for worker in fleet.workers(url).values():
        assert worker["start_speed"] == {"value": 1.096, "source": "profile"}, worker["start_speed"]
        assert worker["speed_source"] == "engine"
