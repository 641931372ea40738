"""A real ms-swift `swift deploy` (CPU, the tiny random-weight model) behind the agent and gateway.

Needs `make swift` (the .venv-swift venv) and `make vllm`'s .cache/tiny. `make test` sets
FLEETGATE_REQUIRE_SWIFT=1, which turns a missing setup into a failure instead of a skip.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from fleetgate.registry import Registry, connect
from fleetgate.schema import WorkerView
from tests.conftest import ROOT, Fleet, require_setup, wait_until

pytestmark = pytest.mark.swift

SWIFT_PYTHON = ROOT / ".venv-swift" / "bin" / "python"
TINY = ROOT / ".cache" / "tiny"
MAX_LEN = 1024


def _require_setup() -> None:
    require_setup("ms-swift", [SWIFT_PYTHON, TINY / "model" / "config.json", TINY / "lora"], "swift", "FLEETGATE_REQUIRE_SWIFT")


def _swift_worker(fleet: Fleet, worker_id: str, *extra: str) -> None:
    fleet.worker(
        worker_id, "--model", str(TINY / "model"), "--served-model-name", "tiny",
        "--adapters", f"lo={TINY / 'lora'}", "--max-model-len", str(MAX_LEN),
        "--option", f"python={SWIFT_PYTHON}", *extra, engine="swift",
    )


@pytest.fixture(scope="module")
def swift_fleet(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    """The gateway and one real swift worker (with a LoRA)."""
    _require_setup()
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("swift"))
    try:
        # Without the tokenizer the agent registers, so that a prompt too long for the
        # model reaches swift and its own refusal is what the client gets translated.
        _, url = fleet.gateway("--set", "registered_tokenizers=false")
        started = time.monotonic()
        _swift_worker(fleet, "swift-cpu")
        fleet.wait_ready(url, "swift-cpu", timeout=180)
        print(f"swift worker ready {time.monotonic() - started:.1f} s after its agent started")
        yield fleet, url
    finally:
        fleet.close()


def test_real_swift_registers_its_model_and_adapter_without_load_reports(
    swift_fleet: tuple[Fleet, str],
) -> None:
    """The agent reads swift's /v1/models; the record says load comes from the gateway's count."""
    fleet, url = swift_fleet
    worker = fleet.workers(url)["swift-cpu"]
    assert worker["engine"] == "swift" and worker["model"] == "tiny"
    assert worker["adapters"] == ["lo"] and worker["max_model_len"] == MAX_LEN
    assert worker["capacity"] == 1

    async def record() -> WorkerView | None:
        redis = connect(fleet.redis_url)
        try:
            return await Registry(redis, fleet.prefix).read("swift-cpu")
        finally:
            await redis.aclose()

    view = asyncio.run(record())
    assert view is not None and not view.info.reports_load and not view.info.runtime_lora


@pytest.mark.parametrize("model", ["tiny", "lo"])
def test_openai_client_through_gateway_to_real_swift(swift_fleet: tuple[Fleet, str], model: str) -> None:
    """Base model and LoRA adapter, whole and streamed, answered by the real swift worker."""
    _, url = swift_fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, max_tokens=6,  # type: ignore[arg-type]
    )
    assert raw.headers["x-fleetgate-worker"] == "swift-cpu"
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage is not None and 0 < completion.usage.completion_tokens <= 6

    with client.chat.completions.with_streaming_response.create(
        model=model, messages=messages, max_tokens=6, stream=True,  # type: ignore[arg-type]
    ) as resp:
        assert resp.headers["x-fleetgate-worker"] == "swift-cpu"
        stream = resp.parse()
        assert isinstance(stream, openai.Stream)
        chunks: list[ChatCompletionChunk] = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_adapter_changes_the_answer(swift_fleet: tuple[Fleet, str]) -> None:
    """The request's model name picks the adapter: greedy outputs of base and LoRA differ."""
    _, url = swift_fleet
    body = {"messages": [{"role": "user", "content": "Count with me"}], "max_tokens": 8, "temperature": 0}
    answers = {
        model: httpx.post(f"{url}/v1/chat/completions", json={**body, "model": model}, timeout=60)
        .json()["choices"][0]["message"]["content"]
        for model in ("tiny", "lo")
    }
    assert answers["tiny"] != answers["lo"]


def test_too_long_prompt_is_an_openai_shaped_400(swift_fleet: tuple[Fleet, str]) -> None:
    """Swift's flat 400 for a prompt over the limit reaches the client in OpenAI's nested shape."""
    _, url = swift_fleet
    # ~3 tokens per "hello " here, yet under the gateway's bytes/8 floor of 1024 tokens,
    # so the gateway forwards it and swift itself refuses it.
    prompt = "hello " * 1200
    resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4}, timeout=60)
    assert resp.status_code == 400 and resp.headers["x-fleetgate-worker"] == "swift-cpu"
    error = resp.json()["error"]
    assert "max_length(1024)" in error["message"] and error["type"] == "invalid_request_error"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=4)


def test_swift_on_a_busy_port_fails_instead_of_moving(fleet_factory: Callable[[], Fleet]) -> None:
    """Swift on its own would bind the next port; under fleetgate a busy port ends the agent."""
    _require_setup()
    fleet = fleet_factory()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _swift_worker(fleet, "swift-busy", "--port", str(port), "--no-warmup", "--health-timeout", "120")
        agent = fleet.procs[-1]
        wait_until(lambda: not agent.alive(), timeout=150, interval=0.5)
    assert agent.popen.returncode == 1
    assert "agent.engine_died" in agent.output()
    engine_log = (fleet.tmp / "swift-busy-engine.log").read_text(errors="replace")
    assert "address already in use" in engine_log
