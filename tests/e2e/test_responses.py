"""The Responses API through the gateway: a stored response lives on the engine that made it,
so follow-ups, retrieves and cancels must reach that engine from any gateway replica.

Two simulated vLLM workers behind two gateway replicas that route round-robin: without
the gateway pinning a follow-up to the worker that stores its previous response, every
other follow-up would land on the wrong engine and fail there with 404.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.conftest import Fleet, wait_until

MODEL = "resp-model"
# Engines keep the responses they make only when asked to (vLLM's own switch).
STORE = ("--model", MODEL, "--option", "time_scale=0.05", "--option", "env={VLLM_ENABLE_RESPONSES_API_STORE: 1}")


@pytest.fixture(scope="module")
def two_gateways(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str, str]]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("responses"))
    try:
        _, first = fleet.gateway("--policy", "round_robin")
        _, second = fleet.gateway("--policy", "round_robin")
        for wid in ("a", "b"):
            fleet.worker(wid, *STORE)
        fleet.wait_ready(first, "a", "b")
        fleet.wait_ready(second, "a", "b")
        yield fleet, first, second
    finally:
        fleet.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def _create(url: str, **kwargs: object) -> tuple[str, str]:
    """(response id, worker that answered) of one non-streamed create."""
    raw = _client(url).responses.with_raw_response.create(model=MODEL, max_output_tokens=8, **kwargs)  # type: ignore[call-overload]
    response = raw.parse()
    # Cut at max_output_tokens, vLLM says "incomplete".
    assert response.status in ("completed", "incomplete")
    assert response.output_text
    return response.id, raw.headers["x-fleetgate-worker"]


def test_follow_ups_reach_the_worker_that_stores_the_conversation(two_gateways: tuple[Fleet, str, str]) -> None:
    """A chain of follow-ups, alternating between two gateway replicas, each on the first one's worker."""
    _, first, second = two_gateways
    response_id, owner = _create(first, input="Tell me about routers.", instructions="Be brief.")
    chain = [owner]
    for turn in range(6):
        response_id, worker = _create(second if turn % 2 == 0 else first, input=f"And then? ({turn})",
                                      previous_response_id=response_id)
        chain.append(worker)
    assert chain == [owner] * 7


def test_a_streamed_response_can_be_continued_and_retrieved(two_gateways: tuple[Fleet, str, str]) -> None:
    _, first, second = two_gateways
    events = list(_client(first).responses.create(model=MODEL, input="Stream, please.", max_output_tokens=8,
                                                  stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    assert "response.output_text.delta" in types
    response_id = events[0].response.id  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.id == response_id and final.usage is not None and final.usage.output_tokens > 0
    # Recorded as the stream went by: another replica finds its worker, twice in a row.
    follow_id, worker = _create(second, input="More.", previous_response_id=response_id)
    _, again = _create(second, input="More.", previous_response_id=response_id)
    assert worker == again
    retrieved = _client(first).responses.retrieve(follow_id)
    assert retrieved.id == follow_id and retrieved.output_text


def test_unknown_or_unstored_responses_are_a_404_in_openai_shape(two_gateways: tuple[Fleet, str, str]) -> None:
    _, first, _ = two_gateways
    with pytest.raises(openai.NotFoundError) as caught:
        _create(first, input="hi", previous_response_id="resp_never_made")
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == "response_not_found" and error["param"] == "previous_response_id"
    # `store: false`: nothing is stored on the engine, and the gateway does not record it either.
    unstored, _ = _create(first, input="forget me", store=False)
    with pytest.raises(openai.NotFoundError):
        _create(first, input="hi", previous_response_id=unstored)
    resp = httpx.get(f"{first}/v1/responses/resp_never_made", timeout=10)
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "response_not_found"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": 5}, "input"),
        ({"model": MODEL, "input": "hi", "previous_response_id": ""}, "previous_response_id"),
        ({"input": "hi"}, "model"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(two_gateways: tuple[Fleet, str, str], body: dict[str, object],
                                                 param: str) -> None:
    _, first, _ = two_gateways
    resp = httpx.post(f"{first}/v1/responses", json=body, timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_a_draining_owner_keeps_its_conversations_until_it_leaves(fleet_factory: Callable[[], Fleet]) -> None:
    """Drain stops new conversations on a worker but not follow-ups to the ones it holds;
    once it has left, a follow-up says so instead of reaching another engine."""
    fleet = fleet_factory()
    _, url = fleet.gateway("--policy", "round_robin")
    procs = {wid: fleet.worker(wid, *STORE) for wid in ("a", "b")}
    fleet.wait_ready(url, "a", "b")
    response_id, owner = _create(url, input="hello")
    other = "b" if owner == "a" else "a"
    with fleet.admin(url) as admin:
        assert admin.post(f"/admin/workers/{owner}/drain").status_code == 200
    wait_until(lambda: fleet.workers(url)[owner]["state"] == "draining", timeout=10)
    assert {_create(url, input="new")[1] for _ in range(4)} == {other}
    response_id, worker = _create(url, input="go on", previous_response_id=response_id)
    assert worker == owner
    procs[owner].stop()
    wait_until(lambda: owner not in fleet.workers(url), timeout=15)
    with pytest.raises(openai.NotFoundError) as caught:
        _create(url, input="still there?", previous_response_id=response_id)
    assert "left the fleet" in str(caught.value)
