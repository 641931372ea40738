"""The simulator's Responses API against real vLLM 0.32 captures (tests/data/vllm_responses/).

Each simulator runs as a real process on loopback with --max-model-len 2048, like the
captured vLLM, so error messages can be compared byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.test_simulator import Sim, start

CAPTURES = Path(__file__).resolve().parents[1] / "data" / "vllm_responses"
# The chat the simulator renders around one user input (ChatML, 4 bytes a token).
CHATML_OVERHEAD = len("<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n")


def capture(name: str) -> tuple[int, str]:
    """(status, body) of a captured `curl -i` answer."""
    head, _, body = (CAPTURES / name).read_text().replace("\r\n", "\n").partition("\n\n")
    return int(head.split()[1]), body.strip()


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data JSON) of each server-sent event."""
    out = []
    for block in text.replace("\r\n", "\n").strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def keys(value: Any) -> Any:
    """The key structure of a JSON value: nested keys, lists by their first element."""
    if isinstance(value, dict):
        return {k: keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [keys(value[0])] if value else []
    return None


def collapse(types: list[str]) -> list[str]:
    """An event-type sequence with runs of text deltas folded into one."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora-resp")
    (path / "adapter_config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def plain() -> Iterator[Sim]:
    """vLLM's default: no response store."""
    server = start("--max-model-len", "2048", "--block-size", "16")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stored(adapter: Path) -> Iterator[Sim]:
    """As vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1, with one LoRA adapter."""
    server = start("--max-model-len", "2048", "--block-size", "16", "--enable-responses-store",
                   "--lora-modules", f"fin={adapter}")  # fmt: skip
    yield server
    server.stop()


def client(sim: Sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)


def test_non_stream_shape_matches_vllm(plain: Sim) -> None:
    """A non-streamed response parses with the official client and has exactly vLLM's keys."""
    out = client(plain).responses.create(
        model="base", input="Hello there", max_output_tokens=8, extra_body={"ignore_eos": True}
    )
    assert out.id.startswith("resp_") and out.object == "response" and out.model == "base"
    assert out.status == "incomplete" and out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "message" and out.output[0].id.startswith("msg_")
    assert out.usage is not None and out.usage.output_tokens == 8
    assert out.usage.total_tokens == out.usage.input_tokens + 8
    raw = httpx.post(plain.url + "/v1/responses",
                     json={"model": "base", "input": "Hello there", "max_output_tokens": 8})  # fmt: skip
    _, body = capture("nostore-create.txt")
    assert list(keys(raw.json()).items()) == list(keys(json.loads(body)).items())  # order too


def test_stream_events_match_vllm(plain: Sim) -> None:
    """A stream sends vLLM's event sequence, event lines and data keys, numbered from 0; the id comes first in response.created."""
    body = {"model": "base", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
            "instructions": "Be brief.", "max_output_tokens": 4, "stream": True, "ignore_eos": True}  # fmt: skip
    resp = httpx.post(plain.url + "/v1/responses", json=body)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream; charset=utf-8"
    ours = sse_events(resp.text)
    _, raw = capture("nostore-stream.txt")
    theirs = sse_events(raw)
    assert collapse([e for e, _ in ours]) == collapse([e for e, _ in theirs])
    assert all(event == data["type"] for event, data in ours)
    assert [d["sequence_number"] for _, d in ours] == list(range(len(ours)))
    shapes = {event: keys(data) for event, data in theirs}
    for event, data in ours:
        assert keys(data) == shapes[event], event
    created, completed = ours[0][1]["response"], ours[-1][1]["response"]
    deltas = "".join(d["delta"] for e, d in ours if e == "response.output_text.delta")
    assert created["id"] == completed["id"] and created["status"] == "in_progress"
    assert completed["output"][0]["content"][0]["text"] == deltas
    assert completed["usage"]["output_tokens"] == 4


def test_stream_with_openai_client(plain: Sim) -> None:
    """The official client reads the stream; its completed response carries the created id."""
    events = list(
        client(plain).responses.create(
            model="base", input="stream please", max_output_tokens=6, stream=True
        )
    )
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.id == events[0].response.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text


def test_follow_up_hits_prefix_cache(stored: Sim) -> None:
    """previous_response_id replays the stored conversation, so the follow-up's prompt hits the prefix cache."""
    api = client(stored)
    first = api.responses.create(model="base", input="Tell me about routers. " * 30,
                                 instructions="Be brief.", max_output_tokens=6)  # fmt: skip
    before = stored.metrics()
    follow = api.responses.create(model="base", input="And then?", instructions="Be brief.",
                                  previous_response_id=first.id, max_output_tokens=6)  # fmt: skip
    after = stored.metrics()
    assert first.usage is not None and follow.usage is not None
    cached = follow.usage.input_tokens_details.cached_tokens
    assert cached >= (first.usage.input_tokens // 16 - 1) * 16 > 0
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    assert hits == cached
    assert after["vllm:request_success_total"] - before["vllm:request_success_total"] == 1
    assert follow.previous_response_id == first.id
    assert api.responses.retrieve(first.id).model_dump() == first.model_dump()


def test_default_is_not_stored(plain: Sim) -> None:
    """Without the store (vLLM's default) a just-made response is unknown to GET and to follow-ups."""
    made = httpx.post(plain.url + "/v1/responses",
                      json={"model": "base", "input": "x", "max_output_tokens": 2}).json()  # fmt: skip
    status, body = capture("nostore-get.txt")
    expected = json.loads(body.replace("resp_9e1732955b155b65", made["id"]))
    got = httpx.get(f"{plain.url}/v1/responses/{made['id']}")
    assert (got.status_code, got.json()) == (status, expected)
    again = httpx.post(plain.url + "/v1/responses", json={"model": "base", "input": "y",
                                                          "previous_response_id": made["id"]})  # fmt: skip
    assert (again.status_code, again.json()) == (status, expected)


UNKNOWN = [
    ("GET", "/v1/responses/resp_nope", None, "store-get-unknown.txt"),
    ("POST", "/v1/responses/resp_nope/cancel", None, "store-cancel-unknown.txt"),
    ("POST", "/v1/responses", {"model": "base", "input": "x", "max_output_tokens": 2,
                               "previous_response_id": "resp_nope"}, "store-prev-unknown.txt"),
]  # fmt: skip


@pytest.mark.parametrize("which", ["plain", "stored"])
@pytest.mark.parametrize(("method", "path", "body", "name"), UNKNOWN)
def test_unknown_ids_answer_as_vllm(
    request: pytest.FixtureRequest, which: str, method: str, path: str,
    body: dict[str, Any] | None, name: str,
) -> None:  # fmt: skip
    """An unknown response id is vLLM's 404 invalid_request_error with param response_id, store or not."""
    sim: Sim = request.getfixturevalue(which)
    resp = httpx.request(method, sim.url + path, json=body)
    status, expected = capture(name)
    assert (resp.status_code, resp.json()) == (status, json.loads(expected))


def _input_of_tokens(n: int) -> str:
    """A string input whose rendered prompt is exactly n byte-estimated tokens."""
    return "x" * (4 * n - CHATML_OVERHEAD)


ERRORS = [
    ({"input": _input_of_tokens(2100), "max_output_tokens": 4}, "nostore-toolong.txt"),
    ({"input": _input_of_tokens(2100), "max_output_tokens": 4, "stream": True},
     "nostore-toolong-stream.txt"),
    ({"input": _input_of_tokens(2048), "max_output_tokens": 4}, "nostore-at-limit.txt"),
    ({"input": "hi", "max_output_tokens": 5000}, "nostore-bigmax.txt"),
    ({"input": "hi", "max_output_tokens": 2, "background": True}, "nostore-background.txt"),
    ({"input": "hi", "max_output_tokens": 2, "model": "nope"}, None),
]  # fmt: skip


@pytest.mark.parametrize(("extra", "name"), ERRORS)
def test_bad_requests_answer_as_vllm(plain: Sim, extra: dict[str, Any], name: str | None) -> None:
    """Too long (over, at the limit, streamed or not), too many output tokens, background without store: vLLM's code and JSON."""
    resp = httpx.post(plain.url + "/v1/responses", json={"model": "base", **extra})
    assert resp.headers["content-type"].startswith("application/json")
    if name is None:  # the model check is the chat path's: same status, type and param
        status, body = capture("nostore-unknown-model.txt")
        err = resp.json()["error"]
        expected = json.loads(body)["error"]
        assert resp.status_code == status and (err["type"], err["param"]) == (expected["type"], expected["param"])
        return
    status, body = capture(name)
    assert (resp.status_code, resp.json()) == (status, json.loads(body))


def test_prompt_plus_output_over_limit_cuts_max_output_tokens(plain: Sim) -> None:
    """As in vLLM, max_output_tokens is cut to what the context leaves, silently."""
    resp = httpx.post(plain.url + "/v1/responses", json={
        "model": "base", "input": _input_of_tokens(1025), "max_output_tokens": 2000})  # fmt: skip
    assert resp.status_code == 200 and resp.json()["max_output_tokens"] == 1023


def test_cancel_of_finished_response_is_400(stored: Sim) -> None:
    """Cancelling a stored, finished response is vLLM's 400 "Cannot cancel a synchronous response."."""
    made = client(stored).responses.create(model="fin", input="x", max_output_tokens=2)
    assert made.model == "fin"
    resp = httpx.post(f"{stored.url}/v1/responses/{made.id}/cancel")
    status, body = capture("store-cancel.txt")
    assert (resp.status_code, resp.json()) == (status, json.loads(body))


def test_background_response_can_be_cancelled(stored: Sim) -> None:
    """With the store, background=true answers "queued"; a cancel makes it "cancelled" and frees the engine."""
    body = {"model": "base", "input": "long", "max_output_tokens": 1500, "background": True,
            "ignore_eos": True}  # fmt: skip
    queued = httpx.post(stored.url + "/v1/responses", json=body).json()
    assert queued["status"] == "queued" and queued["background"] is True
    _, captured = capture("store-cancel-background.txt")
    cancelled = httpx.post(f"{stored.url}/v1/responses/{queued['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert keys(cancelled.json()) == keys(json.loads(captured))
    assert httpx.get(f"{stored.url}/v1/responses/{queued['id']}").json()["status"] == "cancelled"
    assert httpx.get(stored.url + "/sim/state").json()["running"] == 0


def test_lmdeploy_has_no_responses_api() -> None:
    """The LMDeploy flavour answers /v1/responses with FastAPI's 404 {"detail": "Not Found"}."""
    server = start("--flavor", "lmdeploy")
    try:
        for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x")):
            resp = httpx.request(method, server.url + path, json={"model": "base", "input": "x"})
            assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"})
    finally:
        server.stop()
