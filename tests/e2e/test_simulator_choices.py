"""Several choices (`n`) and several completion prompts, against real vLLM 0.32 captures
(tests/data/vllm_choices/).

The simulator runs as a real process on loopback, served as `tiny` with --max-model-len 2048
and vLLM's CPU block size (128) like the captured vLLM, so error messages and metric deltas
compare exactly. Prompt token counts differ (another tokenizer), so bodies are compared by
their key structure, choice indexes and usage arithmetic.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import wait_until
from tests.e2e.test_simulator import Sim, start

CAPTURES = Path(__file__).resolve().parents[1] / "data" / "vllm_choices"
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
HI = [{"role": "user", "content": "Hi"}]
TWO = ["Hello there", "A much longer second prompt here"]


def capture(name: str) -> tuple[int, str]:
    """(status, body) of a captured `curl -i` answer."""
    head, _, body = (CAPTURES / name).read_text().replace("\r\n", "\n").partition("\n\n")
    return int(head.split()[1]), body.strip()


def sse(text: str) -> list[Any]:
    """The data of each server-sent event: JSON, or the string "[DONE]"."""
    out: list[Any] = []
    for block in text.replace("\r\n", "\n").strip().split("\n\n"):
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def keys(value: Any) -> Any:
    """The key structure of a JSON value, in order: nested keys, lists by their first item."""
    if isinstance(value, dict):
        return [(k, keys(v)) for k, v in value.items()]
    if isinstance(value, list):
        return [keys(value[0])] if value else []
    return None


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    """Our body as vLLM without --enable-prompt-tokens-details writes it: the simulator
    always reports cached_tokens (clients and the benchmark read it)."""
    usage = body.get("usage")
    if isinstance(usage, dict) and "prompt_tokens_details" in usage:
        if "completion_tokens_details" in usage:  # a whole body: the field is there, null
            usage["prompt_tokens_details"] = None
        else:  # a usage chunk: vLLM leaves it out
            del usage["prompt_tokens_details"]
    return body


def kind(chunk: dict[str, Any]) -> str:
    """A stream chunk's kind: role, token, finish or usage."""
    if not chunk["choices"]:
        return "usage"
    choice = chunk["choices"][0]
    if choice.get("delta", {}).get("role"):
        return "role"
    return "finish" if choice["finish_reason"] else "token"


@pytest.fixture(scope="module")
def sim() -> Iterator[Sim]:
    server = start("--served-model-name", "tiny", "--max-model-len", "2048", "--block-size", "128",
                   "--num-gpu-blocks", "64")  # fmt: skip
    yield server
    server.stop()


def client(sim: Sim) -> openai.OpenAI:
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n3_with_openai_client(sim: Sim, stream: bool) -> None:
    """n=3 chat: three choices indexed 0..2 with their own text; the prompt counted once,
    every choice's tokens summed."""
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    kw: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
    reply = client(sim).chat.completions.create(
        model="tiny", messages=HI, n=3, max_tokens=4, stream=stream,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True}, **kw,
    )  # fmt: skip
    if stream:
        chunks = list(reply)
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                finishes[c.index] = c.finish_reason
        usage = chunks[-1].usage
    else:
        texts = {c.index: c.message.content or "" for c in reply.choices}
        finishes = {c.index: c.finish_reason for c in reply.choices}
        usage = reply.usage
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 3
    assert set(finishes.values()) == {"length"}
    assert usage is not None and usage.completion_tokens == 12
    one = client(sim).chat.completions.create(model="tiny", messages=HI, max_tokens=1)  # type: ignore[arg-type]
    assert one.usage is not None and usage.prompt_tokens == one.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_completion_prompts_times_n_with_openai_client(sim: Sim, stream: bool) -> None:
    """Two prompts x n=2: four choices, prompt-major (the long prompt's max_tokens is cut
    to its room, so its choices, 2 and 3, are shorter); usage sums each prompt once."""
    long_ids = [7] * 2040  # 8 tokens of room left in 2048
    texts: dict[int, str] = {0: "", 1: "", 2: "", 3: ""}
    finishes: dict[int, str] = {}
    kw: dict[str, Any] = {"extra_body": {"ignore_eos": True}}
    if stream:
        kw["stream_options"] = {"include_usage": True}
    reply = client(sim).completions.create(
        model="tiny", prompt=[[1, 2, 3], long_ids], n=2, max_tokens=20, stream=stream, **kw
    )
    chunks = list(reply) if stream else [reply]
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == 3 + 2040
    assert usage.completion_tokens == 20 + 20 + 8 + 8
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert all(texts.values())


@pytest.mark.parametrize(
    ("name", "path", "body", "choices"),
    [
        ("chat-n3", CHAT, {"messages": HI, "n": 3, "max_tokens": 4}, 3),
        ("cmpl-n3", CMPL, {"prompt": "Hello there", "n": 3, "max_tokens": 4}, 3),
        ("cmpl-2prompts-n2", CMPL, {"prompt": TWO, "n": 2, "max_tokens": 3}, 4),
        ("cmpl-2ids", CMPL, {"prompt": [[1, 2, 3], [4, 5, 6, 7, 8]], "max_tokens": 2}, 2),
        ("chat-nnull", CHAT, {"messages": HI, "n": None, "max_tokens": 2}, 1),
        ("chat-nstrnum", CHAT, {"messages": HI, "n": "2", "max_tokens": 2}, 2),
        ("chat-ntrue", CHAT, {"messages": HI, "n": True, "max_tokens": 2}, 1),
        ("cmpl-bestof", CMPL, {"prompt": "Hi", "n": 1, "best_of": 3, "max_tokens": 2}, 1),
    ],
)
def test_whole_bodies_match_vllm(sim: Sim, name: str, path: str, body: dict[str, Any],
                                 choices: int) -> None:  # fmt: skip
    """Non-streamed bodies have vLLM's keys in vLLM's order, its choice count and indexes,
    and its usage arithmetic."""
    resp = httpx.post(sim.url + path, json={"model": "tiny", **body, "ignore_eos": True})
    status, raw = capture(f"{name}.txt")
    theirs, ours = json.loads(raw), comparable(resp.json())
    assert resp.status_code == status
    assert keys(ours) == keys(theirs)
    assert [c["index"] for c in ours["choices"]] == [c["index"] for c in theirs["choices"]]
    assert len(ours["choices"]) == choices
    usage = ours["usage"]
    assert usage["completion_tokens"] == theirs["usage"]["completion_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert ours["system_fingerprint"].startswith("vllm-0.32.0-")


@pytest.mark.parametrize(
    ("name", "path", "body"),
    [
        ("chat-n2-stream", CHAT, {"messages": HI, "n": 2, "max_tokens": 3}),
        ("cmpl-n2-stream", CMPL, {"prompt": "Hello there", "n": 2, "max_tokens": 3}),
        ("cmpl-2prompts-n2-stream", CMPL, {"prompt": TWO, "n": 2, "max_tokens": 3}),
    ],
)
def test_streams_match_vllm(sim: Sim, name: str, path: str, body: dict[str, Any]) -> None:
    """A stream of several choices: (chat) every choice's role chunk first, then token
    chunks tagged with their index, one finish chunk per choice as its last, one usage
    chunk, then [DONE]; each kind of chunk has vLLM's keys in vLLM's order."""
    resp = httpx.post(sim.url + path, json={"model": "tiny", **body, "ignore_eos": True,
                      "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip
    assert resp.headers["content-type"].startswith("text/event-stream")
    ours, theirs = sse(resp.text), sse(capture(f"{name}.txt")[1])
    assert ours[-1] == theirs[-1] == "[DONE]"
    ours, theirs = [comparable(c) for c in ours[:-1]], theirs[:-1]
    shapes = {kind(c): keys(c) for c in theirs}
    assert {kind(c): keys(c) for c in ours} == shapes
    for chunks in (ours, theirs):
        kinds = [kind(c) for c in chunks]
        indexes = [c["choices"][0]["index"] if c["choices"] else None for c in chunks]
        n = len({i for i in indexes if i is not None})
        roles = kinds.count("role")
        assert indexes[:roles] == list(range(roles)) and roles in (0, n)
        assert kinds[-1] == "usage" and kinds.count("usage") == 1
        for i in range(n):  # one finish chunk per choice, its last
            mine = [k for k, x in zip(kinds, indexes, strict=True) if x == i]
            assert mine[-1] == "finish" and mine.count("finish") == 1
    assert [kind(c) for c in ours].count("role") == [kind(c) for c in theirs].count("role")
    usage = ours[-1]["usage"]
    assert usage["completion_tokens"] == theirs[-1]["usage"]["completion_tokens"]


def test_fingerprint_on_finish_chunks_without_usage(sim: Sim) -> None:
    """Without include_usage, vLLM stamps system_fingerprint on each finish chunk only."""
    resp = httpx.post(sim.url + CHAT, json={"model": "tiny", "messages": HI, "max_tokens": 2,
                      "ignore_eos": True, "stream": True})  # fmt: skip
    ours, theirs = sse(resp.text)[:-1], sse(capture("chat-n1-stream.txt")[1])[:-1]
    assert [keys(c) for c in ours] == [keys(c) for c in theirs]


@pytest.mark.parametrize(
    ("name", "path", "body"),
    [
        ("err-chat-n0", CHAT, {"messages": HI, "n": 0}),
        ("err-chat-n0-stream", CHAT, {"messages": HI, "n": 0, "stream": True}),
        ("err-chat-nneg", CHAT, {"messages": HI, "n": -1}),
        ("err-chat-nbig", CHAT, {"messages": HI, "n": 16385}),
        ("err-chat-nfloat", CHAT, {"messages": HI, "n": 1.5}),
        ("err-chat-nstr", CHAT, {"messages": HI, "n": "two"}),
        ("err-chat-greedy", CHAT, {"messages": HI, "n": 2, "temperature": 0}),
        ("err-cmpl-greedy", CMPL, {"prompt": "Hi", "n": 2, "temperature": 0}),
        ("err-cmpl-n0", CMPL, {"prompt": "Hi", "n": 0}),
        ("err-cmpl-nnull", CMPL, {"prompt": "Hi", "n": None}),
        ("err-cmpl-nbig", CMPL, {"prompt": "Hi", "n": 16385}),
        ("err-cmpl-empty-list", CMPL, {"prompt": []}),
        ("err-cmpl-empty-str", CMPL, {"prompt": ""}),
        ("err-cmpl-empty-str-in-list", CMPL, {"prompt": ["Hi", ""]}),
        ("err-cmpl-empty-ids-in-list", CMPL, {"prompt": [[1, 2], []]}),
        ("err-cmpl-mixed", CMPL, {"prompt": ["Hi", [1, 2]]}),
        ("err-cmpl-ids-str", CMPL, {"prompt": [1, "x"]}),
    ],
)
def test_errors_match_vllm(sim: Sim, name: str, path: str, body: dict[str, Any]) -> None:
    """Bad `n` and bad prompt lists get vLLM's status and error JSON, byte for byte."""
    resp = httpx.post(sim.url + path, json={"model": "tiny", "max_tokens": 2, **body})
    status, raw = capture(f"{name}.txt")
    assert (resp.status_code, resp.json()) == (status, json.loads(raw))


@pytest.mark.parametrize(
    ("name", "body"),
    [
        ("err-cmpl-n0-unknown-model", {"prompt": "Hi", "n": 0}),  # the 404 before n's range
        ("err-cmpl-nstr-unknown-model", {"prompt": "Hi", "n": "x"}),  # the schema before the 404
    ],
)
def test_error_order_matches_vllm(sim: Sim, name: str, body: dict[str, Any]) -> None:
    """Schema errors come before the unknown-model 404, and that before n's range check."""
    resp = httpx.post(sim.url + CMPL, json={"model": "nope", **body})
    status, raw = capture(f"{name}.txt")
    theirs = json.loads(raw)["error"]
    assert resp.status_code == status
    assert {k: resp.json()["error"][k] for k in ("type", "param", "code")} == {
        k: theirs[k] for k in ("type", "param", "code")
    }


def _deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def _captured(name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in (CAPTURES / name).read_text().splitlines():
        key, value = line.rsplit(" ", 1)
        out[key.split("{")[0]] = out.get(key.split("{")[0], 0.0) + float(value)
    return out


WATCHED = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
           "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
           "vllm:request_success_total", "vllm:num_preemptions_total")  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_metrics_of_n3_match_vllm(sim: Sim, stream: bool) -> None:
    """n=3 of a 410-token prompt counts as vLLM's does: three engine requests, the 2nd and
    3rd hitting the full blocks the 1st is computing in the same step."""
    theirs = _deltas(_captured("metrics-n3-before.txt"), _captured("metrics-n3-after.txt"))
    ids = [(1000 + 7 * i + int(stream)) % 5000 for i in range(410)]  # fresh: no earlier hits
    before, before_text = sim.metrics(), httpx.get(sim.url + "/metrics").text
    resp = httpx.post(sim.url + CMPL, json={"model": "tiny", "prompt": ids, "n": 3, "max_tokens": 4,
                      "ignore_eos": True, "stream": stream})  # fmt: skip
    assert resp.status_code == 200
    ours = _deltas(before, sim.metrics())
    assert {k: ours.get(k, 0.0) for k in WATCHED} == {k: theirs.get(k, 0.0) for k in WATCHED}
    assert theirs["vllm:prefix_cache_hits_total"] == 768
    assert _by_source(httpx.get(sim.url + "/metrics").text, before_text) == _by_source(
        (CAPTURES / "metrics-n3-after.txt").read_text(),
        (CAPTURES / "metrics-n3-before.txt").read_text(),
    ) == {"local_compute": 462.0, "local_cache_hit": 768.0, "external_kv_transfer": 0.0}


def _by_source(after: str, before: str) -> dict[str, float]:
    """Deltas of vllm:prompt_tokens_by_source_total, by source."""

    def read(text: str) -> dict[str, float]:
        return {
            line.split('source="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:prompt_tokens_by_source_total{")
        }

    a, b = read(after), read(before)
    return {k: a[k] - b[k] for k in a}


def test_client_gone_aborts_every_choice(sim: Sim) -> None:
    """A client that leaves a stream of several choices frees the engine of all of them."""
    body = {"model": "tiny", "prompt": ["a", "b"], "n": 3, "max_tokens": 1500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    before = sim.metrics().get("vllm:request_success_total", 0.0)
    with httpx.stream("POST", sim.url + CMPL, json=body) as resp:
        next(resp.iter_lines())
    state = lambda: httpx.get(sim.url + "/sim/state").json()  # noqa: E731
    wait_until(lambda: state()["running"] == state()["waiting"] == 0)
    assert sim.metrics().get("vllm:request_success_total", 0.0) == before  # aborted, not finished


def test_lmdeploy_flavour_keeps_one_choice_one_prompt() -> None:
    """LMDeploy's flavour still takes one prompt and n=1 only."""
    server = start("--flavor", "lmdeploy")
    try:
        for path, body in ((CHAT, {"messages": HI, "n": 2}), (CMPL, {"prompt": ["a", "b"]})):
            resp = httpx.post(server.url + path, json={"model": "base", **body})
            assert resp.status_code == 400 and resp.json()["object"] == "error"
    finally:
        server.stop()
