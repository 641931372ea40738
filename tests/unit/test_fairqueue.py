"""Weighted fair queuing (gateway/accounts/fairqueue.py), class priorities (gateway/accounts/priorities.py) and the
admission queue that uses them (gateway/accounts/admission.py): in process, no I/O."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from fleetgate.schema import Load, WorkerInfo, WorkerView
from gateway.accounts.admission import Admission, Shed
from gateway.accounts.fairqueue import FairQueue
from gateway.accounts.priorities import Priorities
from gateway.errors import InvalidRequest
from gateway.routing import FullAt, Live
from gateway.routing.table import Slot
from gateway.settings import GatewaySettings, PriorityClass
from gateway.tenants.auth import digest


def drain(q: FairQueue[str], n: int | None = None) -> list[str]:
    """Serve `n` (default: all) waiters in the order the queue chooses them."""
    out: list[str] = []
    while len(q) and (n is None or len(out) < n):
        head = q.first()
        assert head is not None
        q.pop(head)
        out.append(head.item)
    return out


# (pushes as (item, class, key, tokens), expected serving order)
ORDER_CASES = [
    pytest.param([("a", "default", "", 1), ("b", "default", "", 500), ("c", "default", "", 1)],
                 ["a", "b", "c"], id="one-key-one-class-is-fifo"),
    pytest.param([("b1", "default", "big", 1000), ("b2", "default", "big", 1000), ("b3", "default", "big", 1000),
                  ("s1", "default", "small", 100), ("s2", "default", "small", 100), ("s3", "default", "small", 100)],
                 ["b1", "s1", "s2", "s3", "b2", "b3"], id="tokens-not-requests-across-keys"),
    pytest.param([("x1", "default", "x", 10), ("x2", "default", "x", 10), ("y1", "default", "y", 10),
                  ("y2", "default", "y", 10)],
                 ["x1", "y1", "x2", "y2"], id="equal-keys-alternate"),
    pytest.param([("bat", "batch", "k", 100), ("int", "interactive", "k", 100)],
                 ["int", "bat"], id="even-tags-go-to-the-heavier-class"),
]


@pytest.mark.parametrize(("pushes", "expected"), ORDER_CASES)
def test_the_queue_serves_in_fair_order(pushes: list[tuple[str, str, str, int]], expected: list[str]) -> None:
    """Within a class keys share by tokens (a big request pushes back its own key only); one key is FIFO."""
    q: FairQueue[str] = FairQueue({"interactive": 8, "default": 4, "batch": 1})
    for item, cls, key, tokens in pushes:
        q.push(item, cls, key, tokens)
    assert drain(q) == expected


# (weights, tokens per request of each class, expected share of interactive in admissions)
WEIGHT_CASES = [
    pytest.param({"interactive": 8, "batch": 1}, {"interactive": 100, "batch": 100}, 8 / 9, id="8:1-equal-sizes"),
    pytest.param({"interactive": 1, "batch": 1}, {"interactive": 100, "batch": 100}, 1 / 2, id="1:1"),
    # Batch requests 10x the size: per token 8:1, so per request 80:1.
    pytest.param({"interactive": 8, "batch": 1}, {"interactive": 100, "batch": 1000}, 80 / 81, id="8:1-big-batch"),
]


@pytest.mark.parametrize(("weights", "tokens", "share"), WEIGHT_CASES)
def test_backlogged_classes_share_admissions_by_weight_in_tokens(
    weights: dict[str, float], tokens: dict[str, int], share: float,
) -> None:
    """With both classes always waiting, the admitted tokens split as the weights say."""
    q: FairQueue[str] = FairQueue(weights)
    for cls in weights:
        for _ in range(2000):
            q.push(cls, cls, cls, tokens[cls])
    served = Counter(drain(q, 1000))
    assert served["interactive"] / 1000 == pytest.approx(share, abs=0.01)


def test_a_batch_key_with_huge_requests_does_not_starve_an_interactive_key() -> None:
    """A flood of 4,000-token batch requests queued first; interactive arrivals still go within a few admissions."""
    q: FairQueue[str] = FairQueue({"interactive": 8, "batch": 1})
    for i in range(200):
        q.push(f"batch{i}", "batch", "bulk", 4000)
    drain(q, 50)  # the flood has been served a while
    q.push("chat", "interactive", "team", 300)
    assert drain(q, 2)[0] == "chat"


def test_an_idle_class_banks_no_credit() -> None:
    """A class that waited for nothing long does not get a burst of turns ahead of a backlogged one."""
    q: FairQueue[str] = FairQueue({"a": 1, "b": 1})
    for _ in range(100):
        q.push("a", "a", "", 10)
    drain(q, 90)
    for _ in range(10):
        q.push("b", "b", "", 10)
    assert drain(q, 4) == ["b", "a", "b", "a"]


def test_a_removed_waiter_leaves_no_charge_to_its_key() -> None:
    """A request that gave up (timeout, client gone) does not push back its key's next request."""
    q: FairQueue[str] = FairQueue({"default": 1})
    q.push("x0", "default", "x", 10)
    gone = q.push("x1", "default", "x", 1000)
    q.remove(gone)
    q.remove(gone)  # twice is a no-op
    q.push("y0", "default", "y", 10)
    q.push("x2", "default", "x", 10)
    assert len(q) == 3 and drain(q) == ["x0", "y0", "x2"]


VICTIM_CASES = [
    pytest.param(8, "batch", "b2", id="newest-of-the-lightest"),
    pytest.param(4, "batch", "b2", id="default-displaces-batch"),
    pytest.param(1, None, None, id="batch-displaces-nobody"),
]


@pytest.mark.parametrize(("weight", "cls", "item"), VICTIM_CASES)
def test_a_full_queue_displaces_the_newest_waiter_of_the_lightest_lighter_class(
    weight: float, cls: str | None, item: str | None,
) -> None:
    q: FairQueue[str] = FairQueue({"interactive": 8, "default": 4, "batch": 1})
    for name, c in (("d1", "default"), ("b1", "batch"), ("b2", "batch"), ("d2", "default")):
        q.push(name, c, "", 10)
    victim = q.victim(weight)
    assert (victim.cls, victim.item) == (cls, item) if victim else cls is None


# -- priorities: which class a request is in -------------------------------------------


KEYS = ("sk-interactive-0001", "sk-batch-0002", "sk-plain-0003")


def priorities() -> Priorities:
    settings = GatewaySettings(
        api_keys=KEYS,
        priority_classes={"interactive": PriorityClass(weight=8), "default": PriorityClass(weight=4),
                          "batch": PriorityClass(weight=1, share=0.5, queue_timeout_s=30)},
        key_priority={"0001": "interactive", digest("sk-batch-0002")[:4].hex(): "batch"},
    )
    return Priorities.from_settings(settings)


def kid(key: str) -> str:
    return digest(key)[:4].hex()


HEADER_CASES = [
    pytest.param("sk-interactive-0001", None, "interactive", id="key-suffix-maps-the-class"),
    pytest.param("sk-batch-0002", None, "batch", id="key-id-maps-the-class"),
    pytest.param("sk-plain-0003", None, "default", id="unmapped-key-is-default"),
    pytest.param("sk-interactive-0001", "batch", "batch", id="a-key-may-lower-its-class"),
    pytest.param("sk-interactive-0001", " Default ", "default", id="header-case-and-space"),
    pytest.param("sk-plain-0003", "default", "default", id="its-own-class"),
    pytest.param("sk-batch-0002", "interactive", InvalidRequest, id="never-above-its-class"),
    pytest.param("sk-plain-0003", "urgent", InvalidRequest, id="unknown-class"),
]


@pytest.mark.parametrize(("key", "header", "expected"), HEADER_CASES)
def test_a_request_gets_its_keys_class_or_a_lower_one_it_asks_for(
    key: str, header: str | None, expected: str | type[Exception],
) -> None:
    p = priorities()
    if isinstance(expected, str):
        assert p.priority_of(kid(key), header).name == expected
        return
    with pytest.raises(InvalidRequest) as caught:
        p.priority_of(kid(key), header)
    assert caught.value.status == 400 and caught.value.type == "invalid_request_error"
    assert caught.value.param == "x-fleetgate-priority" and "batch" in caught.value.message  # what it may use


def test_default_settings_are_one_fifo_class_and_bad_names_fail_at_start() -> None:
    plain = Priorities.from_settings(GatewaySettings())
    assert not plain.enabled and list(plain.classes) == ["default"]
    assert plain.priority_of("", None).full_at(FullAt()) == FullAt()
    with pytest.raises(ValueError, match="not a priority class"):
        Priorities.from_settings(GatewaySettings(api_keys=KEYS, key_priority={"0001": "vip"}))
    with pytest.raises(ValueError, match="no configured API key"):
        Priorities.from_settings(GatewaySettings(api_keys=KEYS, key_priority={"9999": "default"}))
    with pytest.raises(ValueError, match="more than one"):
        Priorities.from_settings(GatewaySettings(api_keys=("sk-a-0001", "sk-b-0001"), key_priority={"0001": "default"}))
    with pytest.raises(ValueError, match="share"):
        Priorities.from_settings(GatewaySettings(priority_classes={"default": PriorityClass(share=0)}))


def test_a_class_share_counts_a_worker_full_earlier() -> None:
    """FullAt.share: capacity 10 x (1 + 1.0) = 20 requests by default; at share 0.4 the class stops at 8."""
    slot = Slot(WorkerView(info=WorkerInfo(id="a", url="http://a", engine="sim", model="m", capacity=10),
                           state="ready", load=Load()))
    assert FullAt().why(slot, Live({"a": 8})) is None
    assert FullAt(share=0.4).why(slot, Live({"a": 7})) is None
    assert FullAt(share=0.4).why(slot, Live({"a": 8})) == "slots"


# -- the admission queue ---------------------------------------------------------------


WEIGHTS = {"interactive": 8.0, "default": 4.0, "batch": 1.0}


def test_room_goes_to_the_interactive_arrival_before_the_batch_backlog() -> None:
    """With batch requests waiting first, the next room that opens goes to a later interactive one."""

    async def main() -> list[str]:
        admission = Admission(limit=lambda: 100, recheck_s=5.0, weights=WEIGHTS)
        room = [0]
        order: list[str] = []

        def full() -> str | None:
            return None if room[0] > 0 else "slots"

        async def one(name: str, cls: str) -> None:
            await admission.wait("m", full, time.monotonic() + 10, 1.0, priority=cls, key=cls, tokens=500)
            room[0] -= 1  # it takes its place, as a request does before its first await
            order.append(name)

        tasks = [asyncio.create_task(one(f"b{i}", "batch")) for i in range(5)]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(one("i0", "interactive")))
        await asyncio.sleep(0.01)
        for _ in range(6):
            room[0] += 1
            admission.wake()
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(main())
    assert order[0] == "i0" and sorted(order[1:]) == [f"b{i}" for i in range(5)]


def test_a_full_queue_sheds_the_newest_batch_waiter_for_an_interactive_arrival() -> None:
    """queue_full: an interactive arrival takes the place of the newest batch waiter; a batch arrival is refused."""

    async def main() -> tuple[list[str], dict[tuple[str, str], int], dict[str, int]]:
        admission = Admission(limit=lambda: 3, recheck_s=5.0, weights=WEIGHTS)
        events: list[str] = []

        async def one(name: str, cls: str) -> None:
            try:
                await admission.wait("m", lambda: "slots", time.monotonic() + 0.3, 1.0, priority=cls, tokens=10)
            except Shed as shed:
                events.append(f"{name}:{shed.reason}")

        tasks = []
        for i in range(3):
            tasks.append(asyncio.create_task(one(f"b{i}", "batch")))
            await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(one("b3", "batch")))  # full, nobody lighter: refused
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(one("i0", "interactive")))  # displaces b2
        await asyncio.sleep(0.01)
        depths = admission.class_depths()
        await asyncio.gather(*tasks)
        return events, admission.sheds, depths

    events, sheds, depths = asyncio.run(main())
    assert events[:2] == ["b3:queue_full", "b2:queue_full"]
    assert sorted(events[2:]) == ["b0:queue_timeout", "b1:queue_timeout", "i0:queue_timeout"]
    assert depths == {"interactive": 1, "default": 0, "batch": 2}
    assert sheds == {("batch", "queue_full"): 2, ("batch", "queue_timeout"): 2, ("interactive", "queue_timeout"): 1}


def test_one_class_is_first_come_first_served() -> None:
    """Default settings: one class, no key: the queue admits in arrival order, one per room."""

    async def main() -> list[int]:
        admission = Admission(limit=lambda: 100, recheck_s=5.0)
        room = [0]
        order: list[int] = []

        async def one(i: int) -> None:
            await admission.wait("m", lambda: None if room[0] > 0 else "slots", time.monotonic() + 10, 1.0,
                                 tokens=1000 - i * 100)
            room[0] -= 1
            order.append(i)

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.005)
        room[0] = 5
        admission.wake()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == [0, 1, 2, 3, 4]


def test_within_a_class_keys_are_admitted_by_tokens_not_requests() -> None:
    """A key of 1,000-token requests queued first, then a key of 100-token ones: of the next 11
    admissions the small key gets 10 (the same tokens as the big key's one)."""

    async def main() -> list[str]:
        admission = Admission(limit=lambda: 100, recheck_s=5.0, weights={"default": 1.0, "batch": 0.5})
        room = [0]
        order: list[str] = []
        eleven = asyncio.Event()

        async def one(key: str, tokens: int) -> None:
            await admission.wait("m", lambda: None if room[0] > 0 else "slots", time.monotonic() + 10, 1.0,
                                 priority="default", key=key, tokens=tokens)
            room[0] -= 1
            order.append(key)
            if len(order) == 11:
                eleven.set()

        tasks = [asyncio.create_task(one("big", 1000)) for _ in range(5)]
        await asyncio.sleep(0.01)
        tasks += [asyncio.create_task(one("small", 100)) for _ in range(20)]
        await asyncio.sleep(0.01)
        room[0] = 11
        admission.wake()
        await eleven.wait()
        room[0] = 100
        admission.wake()
        await asyncio.gather(*tasks)
        return order[:11]

    assert Counter(asyncio.run(main())) == {"big": 1, "small": 10}
