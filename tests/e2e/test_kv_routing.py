"""Precise prefix routing on real processes: the gateway renders a request's prompt with the
model's chat template and tokenizer (the tiny model's, which the agents register and the
simulator tokenizes with, as vLLM would), looks it up in the engines' KV indexes (their cache
events, through Redis) and sends it where the engine holds it: a prompt another client warmed,
a prefix evicted at its home. Two gateway replicas choose alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from tests.conftest import Fleet, require_setup
from tests.e2e.test_context_length import TINY

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron".split()


def system_prompt(i: int) -> str:
    """A system prompt of its own (~400 tokens), unlike every other test's."""
    return f"You are assistant number {i}. " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(300))


def chat(system: str, question: str) -> dict[str, object]:
    return {"model": "model", "max_tokens": 4, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": question}]}


# The config's routing block with a rebalance threshold no fleet reaches (homes stay put).
STILL_HOMES = ("--set", 'routing={"balance": 1000, "kv_high": 0.9}')


def start(fleet: Fleet, *gateway_args: str, blocks: int = 4096) -> tuple[str, dict[str, str]]:
    require_setup("tokenizer", [TINY / "tokenizer.json"], "vllm", "FLEETGATE_REQUIRE_VLLM")
    _, url = fleet.gateway(*gateway_args)
    for wid in ("a", "b"):
        fleet.worker(wid, "--model", str(TINY), "--option", "time_scale=0.05", "--option", "block_size=16",
                     "--option", f"num_gpu_blocks={blocks}")
    fleet.wait_ready(url, "a", "b")
    deadline = time.monotonic() + 30
    while True:
        views = fleet.workers(url)
        if all((w.get("kv_events") or {}).get("state") == "events" for w in views.values()):  # type: ignore[union-attr]
            break
        assert time.monotonic() < deadline, views
        time.sleep(0.1)
    return url, {wid: str(w["url"]) for wid, w in views.items()}


def blocks(fleet: Fleet, url: str, wid: str) -> int:
    return int(fleet.workers(url)[wid]["kv_events"]["blocks"])  # type: ignore[index]


def settled_blocks(fleet: Fleet, url: str, wid: str) -> int:
    """Worker `wid`'s block count once the gateway's mirror has caught up with what the engine
    served before (the same in three reads 0.2 s apart; the mirror refreshes every 0.1 s)."""
    counts = [blocks(fleet, url, wid)]
    deadline = time.monotonic() + 10
    while len(counts) < 3 or len(set(counts[-3:])) > 1:
        assert time.monotonic() < deadline, counts
        time.sleep(0.2)
        counts.append(blocks(fleet, url, wid))
    return counts[-1]


def index_version(fleet: Fleet, url: str, wid: str) -> str:
    return str(fleet.workers(url)[wid]["kv_events"]["version"])  # type: ignore[index]


def settled_after(fleet: Fleet, url: str, wid: str, before: str, quiet_s: float = 1.0) -> str:
    """Wait until the gateway's copy of worker `wid`'s index has moved past version `before`
    and then stayed at one version for `quiet_s` (ten of the mirror's refreshes): the engine's
    events for what it served before have reached it. Block counts cannot tell this once the
    cache is full (every stored block evicts one)."""
    deadline = time.monotonic() + 15
    version, since = index_version(fleet, url, wid), time.monotonic()
    while version == before or time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, (before, version)
        time.sleep(0.1)
        now = index_version(fleet, url, wid)
        if now != version:
            version, since = now, time.monotonic()
    return version


def warm(fleet: Fleet, url: str, engine: str, wid: str, body: dict[str, object], path: str,
         *replicas: str) -> None:
    """Send `body` straight to worker `wid`'s engine (another client), and wait until the
    mirror of the gateway at `url` (and of every replica named after `path`) holds its blocks,
    counted from a settled start, so that the blocks of a request served just before are not
    taken for these. Each replica mirrors the events on its own and may lag the others."""
    gateways = (url, *replicas)
    before = {g: settled_blocks(fleet, g, wid) for g in gateways}
    assert httpx.post(f"{engine}{path}", json=body, timeout=30).status_code == 200
    deadline = time.monotonic() + 10
    for g in gateways:
        while blocks(fleet, g, wid) < before[g] + 16:
            assert time.monotonic() < deadline, f"{wid}'s index did not grow at {g}"
            time.sleep(0.05)


def routed(url: str, body: dict[str, object], path: str = "/v1/chat/completions") -> tuple[str, str]:
    resp = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-fleetgate-worker"], resp.headers["x-fleetgate-route"]


def test_prompts_another_client_warmed_are_routed_where_the_engine_holds_them(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """Six system prompts, each warmed on one engine (alternately a, b) by a client that
    bypasses the gateway: a new question under each goes to that engine through either of two
    gateway replicas (placed there by the engine's cache), and stays there; a completion's
    prompt too. Without the events the placement would choose by its ring alone."""
    fleet = fleet_factory()
    # No background rebalance: it may move a key's home between two of its requests (once a
    # second, sooner or later on a slower machine), and the third request's route would then
    # name the engine's cache (kv-hit) rather than the home (prefix-hit), to the same engine.
    url, engines = start(fleet, *STILL_HOMES)
    _, other = fleet.gateway(*STILL_HOMES)
    got, want = [], []
    for i in range(6):
        target = "ab"[i % 2]
        warm(fleet, url, engines[target], target, chat(system_prompt(i), "first question"), "/v1/chat/completions",
             other)
        first = routed(url, chat(system_prompt(i), f"second question {i}"))
        replica = routed(other, chat(system_prompt(i), f"third question {i}"))
        again = routed(url, chat(system_prompt(i), f"fourth question {i}"))
        got.append((first, replica, again))
        want.append(((target, "fleet:kv-placed"), (target, "fleet:kv-placed"), (target, "fleet:prefix-hit")))
    print(f"kv-routing: {got}")
    assert got == want
    prompt = "A completion prompt that another client sent first. " + system_prompt(99)
    warm(fleet, url, engines["b"], "b", {"model": "model", "prompt": prompt, "max_tokens": 4}, "/v1/completions")
    assert routed(url, {"model": "model", "prompt": prompt + " More.", "max_tokens": 4}, "/v1/completions") == (
        "b", "fleet:kv-placed")


def test_an_evicted_prefix_moves_the_next_request_to_the_engine_that_still_holds_it(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """A system prompt placed on its home through the gateway, and also cached on the other
    engine; then the home's small cache is filled with other prompts until it evicts it: the
    next request goes to the engine that still holds it (kv-hit), not home."""
    fleet = fleet_factory()
    # Homes kept still (as in the test above): the background rebalance may move the key's home
    # to the engine that still holds it, whose route would then say prefix-hit, not kv-hit.
    url, engines = start(fleet, *STILL_HOMES, blocks=96)  # 1,536 tokens of KV each: four prompts' worth
    system = system_prompt(7)
    home, reason = routed(url, chat(system, "placed"))
    assert reason == "fleet:prefix-placed"
    other = "b" if home == "a" else "a"
    warm(fleet, url, engines[other], other, chat(system, "warmed elsewhere"), "/v1/chat/completions")
    assert routed(url, chat(system, "still home")) == (home, "fleet:prefix-hit")
    before = index_version(fleet, url, home)
    for j in range(8):  # other prompts straight to the home's engine: its cache must evict
        resp = httpx.post(f"{engines[home]}/v1/chat/completions", json=chat(system_prompt(100 + j), "evict"), timeout=30)
        assert resp.status_code == 200, resp.text
    # One request only, once the gateway has the evictions: a request routed home before then
    # would store the prompt there again, and every later one would rightly follow it.
    settled_after(fleet, url, home, before)
    assert routed(url, chat(system, "after eviction")) == (other, "fleet:kv-hit")


def test_a_worker_whose_publisher_dies_falls_back_to_the_placement_and_nothing_fails(
    fleet_factory: Callable[[], Fleet],
) -> None:
    """vLLM's publisher gone while its engine serves on (the simulator's `kv_events_down`
    fault): within about a second the gateway reads that worker's index as lost
    (/admin/workers, fleetgate_worker_kv_events_up 0) and no longer trusts what its index
    held (a prompt warmed there before is placed, not kv-placed), the other worker's events
    still route, and every request is answered."""
    fleet = fleet_factory()
    url, engines = start(fleet)
    warm(fleet, url, engines["b"], "b", chat(system_prompt(20), "first"), "/v1/chat/completions")
    assert routed(url, chat(system_prompt(20), "second")) == ("b", "fleet:kv-placed")
    warm(fleet, url, engines["b"], "b", chat(system_prompt(21), "warm"), "/v1/chat/completions")
    assert httpx.post(f"{engines['b']}/sim/faults", json={"kv_events_down": 1}, timeout=10).status_code == 200
    cut = time.monotonic()
    while (state := fleet.workers(url)["b"]["kv_events"]["state"]) != "lost":  # type: ignore[index]
        assert time.monotonic() - cut < 10, state
        time.sleep(0.05)
    lost_after = time.monotonic() - cut
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'fleetgate_worker_kv_events_up{worker="b"} 0.0' in metrics
    assert 'fleetgate_worker_kv_events_up{worker="a"} 1.0' in metrics
    fallback = routed(url, chat(system_prompt(21), "after"))
    warm(fleet, url, engines["a"], "a", chat(system_prompt(22), "first"), "/v1/chat/completions")
    still = routed(url, chat(system_prompt(22), "second"))
    answered = [routed(url, chat(system_prompt(30 + i), "load"))[1] for i in range(10)]
    print(f"kv-fallback: lost after {lost_after:.2f} s, fallback {fallback}, a still {still}, reasons {answered}")
    assert lost_after < 3.0
    assert fallback[1] == "fleet:prefix-placed"
    assert still == ("a", "fleet:kv-placed")
    assert all(not r.startswith("fleet:kv-") for r in answered)
