"""The simulator as clients and gateways see it: real processes over loopback."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from httpx_sse import aconnect_sse

from workers.engines.base import AdapterError, EngineSpec
from workers.engines.sim import SimEngine
from workers.simulator.tokens import render_chat

ROOT = Path(__file__).resolve().parent.parent
FAST = "0.02"


class Sim:
    """A running simulator process."""

    def __init__(self, argv: list[str], port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"simulator exited: {self.proc.stderr.read().decode() if self.proc.stderr else ''}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("simulator did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: {sample name: sum over label sets}."""
        out: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
                out[name] = out.get(name, 0.0) + value
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(*args: str) -> Sim:
    port = free_port()
    argv = [sys.executable, "-m", "workers.simulator", "--port", str(port),
            "--served-model-name", "base", "--time-scale", FAST, *args]  # fmt: skip
    return Sim(argv, port)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lora-fin")
    (path / "adapter_config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def sim(adapter_dir: Path) -> Iterator[Sim]:
    """The main simulator, started from the argv that SimEngine builds for the agent."""
    port = free_port()
    spec = EngineSpec(
        model="demo-7b", served_name="base", port=port, max_model_len=2048,
        adapters={"fin": str(adapter_dir)},
        options={"time_scale": float(FAST), "max_num_seqs": 2, "seed": 7},
    )  # fmt: skip
    server = Sim(SimEngine().command(spec), port)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_kv() -> Iterator[Sim]:
    server = start("--num-gpu-blocks", "20", "--block-size", "16", "--max-model-len", "512")
    yield server
    server.stop()


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "base", "messages": [{"role": "user", "content": content}], **extra}


def test_engine_command_maps_spec(adapter_dir: Path) -> None:
    """SimEngine turns a spec into the simulator's flags, profile and adapters included."""
    spec = EngineSpec(
        model="m", served_name="s", port=9, adapters={"a": str(adapter_dir)},
        options={"profile": "h200-7b", "max_num_seqs": 8, "faults": ["error_rate=0.5"]},
    )  # fmt: skip
    argv = SimEngine().command(spec)
    assert argv[1:3] == ["-m", "workers.simulator"]
    assert argv[argv.index("--profile") + 1] == "h200-7b"
    assert argv[argv.index("--max-num-seqs") + 1] == "8"
    assert argv[argv.index("--lora-modules") + 1] == f"a={adapter_dir}"
    assert argv[argv.index("--fault") + 1] == "error_rate=0.5"
    assert SimEngine().capacity(spec) == 8 and SimEngine().max_loras(spec) == 4


def test_models_list_base_and_adapter(sim: Sim) -> None:
    """/v1/models lists the base with max_model_len and each adapter with parent = base."""
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x")
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert cards["base"]["parent"] is None and cards["base"]["max_model_len"] == 2048
    assert cards["fin"]["parent"] == "base"


def test_chat_non_stream_with_openai_client(sim: Sim) -> None:
    """A chat completion parses with the official client and its usage adds up."""
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x")
    out = client.chat.completions.create(
        model="base", messages=[{"role": "user", "content": "hello"}], max_tokens=12
    )
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage is not None and out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    rendered = render_chat(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, continue_final=False
    )
    assert out.usage.prompt_tokens == math.ceil(len(rendered.encode()) / 4)


async def test_chat_stream_shape_and_token_count(sim: Sim) -> None:
    """A chat stream opens with the role, ends with finish_reason, usage, [DONE]; usage counts the chunks."""
    body = chat_body("stream please", stream=True, max_tokens=30, ignore_eos=True,
                     stream_options={"include_usage": True})  # fmt: skip
    async with (
        httpx.AsyncClient() as client,
        aconnect_sse(client, "POST", sim.url + "/v1/chat/completions", json=body) as source,
    ):
        raw = [event.data async for event in source.aiter_sse()]
    assert raw[-1] == "[DONE]"
    chunks = [json.loads(d) for d in raw[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in content)
    assert [c["choices"][0]["finish_reason"] for c in content][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in content[:-1])
    assert (
        chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["completion_tokens"] == len(content) == 30
    )


def test_completions_stream_and_not_with_openai_client(sim: Sim) -> None:
    """/v1/completions works with the official client, whole and streamed, with usage."""
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x")
    whole = client.completions.create(
        model="base", prompt="Once upon", max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert whole.object == "text_completion" and whole.usage is not None
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    stream = client.completions.create(
        model="base", prompt="Once upon", max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text  # same prompt, same seed: same text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_seed_changes_text(sim: Sim) -> None:
    """Text is deterministic for a request and changes with its seed."""

    def text(seed: int) -> str:
        body = {
            "model": "base",
            "prompt": "seeded",
            "max_tokens": 10,
            "ignore_eos": True,
            "seed": seed,
        }
        return str(httpx.post(sim.url + "/v1/completions", json=body).json()["choices"][0]["text"])

    assert text(1) == text(1) != text(2)


def test_unknown_model_is_404_in_vllm_shape(sim: Sim) -> None:
    """An unknown model gets vLLM's nested 404 NotFoundError with param "model"."""
    resp = httpx.post(sim.url + "/v1/chat/completions", json={**chat_body("x"), "model": "nope"})
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["type"] == "NotFoundError" and err["param"] == "model" and err["code"] == 404
    assert "nope" in err["message"]


def test_too_long_prompt_is_400_stream_or_not(sim: Sim) -> None:
    """A prompt over max_model_len is a 400 BadRequestError, before any data even when streaming."""
    for stream in (False, True):
        resp = httpx.post(sim.url + "/v1/completions",
                          json={"model": "base", "prompt": "abcd" * 2100, "stream": stream})  # fmt: skip
        assert resp.status_code == 400 and resp.headers["content-type"].startswith(
            "application/json"
        )
        err = resp.json()["error"]
        assert err["type"] == "BadRequestError" and err["param"] == "input_tokens"


def test_max_tokens_cut_to_context(sim: Sim) -> None:
    """prompt + max_tokens over max_model_len silently cuts max_tokens."""
    body = {"model": "base", "prompt": "abcd" * 2000, "max_tokens": 500, "ignore_eos": True}
    resp = httpx.post(sim.url + "/v1/completions", json=body)
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] == 2000 and usage["completion_tokens"] == 48
    assert resp.json()["choices"][0]["finish_reason"] == "length"


async def test_queue_shows_in_metrics(sim: Sim) -> None:
    """With max_num_seqs 2, a burst of 6 requests shows waiting > 0 and running <= 2 in /metrics."""
    engine = SimEngine()
    seen = []
    async with httpx.AsyncClient(timeout=30) as client:
        body = chat_body("queue me", max_tokens=150, ignore_eos=True)
        tasks = [
            asyncio.create_task(client.post(sim.url + "/v1/chat/completions", json=body))
            for _ in range(6)
        ]
        while not all(t.done() for t in tasks):
            seen.append(engine.parse_metrics((await client.get(sim.url + "/metrics")).text))
            await asyncio.sleep(0.005)
        assert all(t.result().status_code == 200 for t in tasks)
    assert max(load.waiting for load in seen) > 0
    assert max(load.running for load in seen) == 2


def test_prefix_cache_hits_counted_in_tokens(sim: Sim) -> None:
    """A repeated long prompt hits the prefix cache in whole blocks; metrics count tokens; adapters don't share."""
    before = sim.metrics()
    prompt = "The prefix that repeats. " * 160
    body = {"model": "base", "prompt": prompt, "max_tokens": 2}
    first = httpx.post(sim.url + "/v1/completions", json=body).json()["usage"]
    second = httpx.post(sim.url + "/v1/completions", json=body).json()["usage"]
    other = httpx.post(sim.url + "/v1/completions", json={**body, "model": "fin"}).json()["usage"]
    n = first["prompt_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert other["prompt_tokens_details"]["cached_tokens"] == 0
    after = sim.metrics()
    assert (
        after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"]
        == 3 * n
    )
    assert (
        after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
        == (n - 1) // 16 * 16
    )


def test_continue_final_message(sim: Sim) -> None:
    """continue_final_message continues the assistant text; with add_generation_prompt too it is a 400."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I"}]
    body = {"model": "base", "messages": messages, "max_tokens": 3, "continue_final_message": True}
    assert httpx.post(sim.url + "/v1/chat/completions", json=body).status_code == 400
    resp = httpx.post(
        sim.url + "/v1/chat/completions", json={**body, "add_generation_prompt": False}
    )
    rendered = render_chat(messages, add_generation_prompt=False, continue_final=True)
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == math.ceil(len(rendered.encode()) / 4)


async def test_lora_load_unload_codes(sim: Sim, adapter_dir: Path) -> None:
    """Adapters load (200, plain text), reload (400), bad path (404), unload unknown (404), unload (200)."""
    engine = SimEngine()
    async with httpx.AsyncClient() as client:
        resp = await client.post(sim.url + "/v1/load_lora_adapter",
                                 json={"lora_name": "legal", "lora_path": str(adapter_dir)})  # fmt: skip
        assert resp.status_code == 200 and "added successfully" in resp.text
        assert not resp.headers["content-type"].startswith("application/json")
        with pytest.raises(AdapterError) as again:
            await engine.load_adapter(client, sim.url, "legal", str(adapter_dir))
        assert again.value.status == 400
        with pytest.raises(AdapterError) as missing:
            await engine.load_adapter(client, sim.url, "ghost", "/nonexistent/lora")
        assert missing.value.status == 404
        ok = await client.post(
            sim.url + "/v1/completions", json={"model": "legal", "prompt": "hi", "max_tokens": 2}
        )
        assert ok.status_code == 200
        with pytest.raises(AdapterError) as unknown:
            await engine.unload_adapter(client, sim.url, "ghost")
        assert unknown.value.status == 404
        await engine.unload_adapter(client, sim.url, "legal")
        ids = [m["id"] for m in (await client.get(sim.url + "/v1/models")).json()["data"]]
        assert "legal" not in ids and "fin" in ids


async def test_client_disconnect_aborts_sequence(sim: Sim) -> None:
    """A client that leaves mid-stream frees its sequence, which does not count as a success."""
    before = sim.metrics().get("vllm:request_success_total", 0.0)
    body = chat_body("long", stream=True, max_tokens=1500, ignore_eos=True)
    async with httpx.AsyncClient() as client:
        async with aconnect_sse(
            client, "POST", sim.url + "/v1/chat/completions", json=body
        ) as source:
            async for _ in source.aiter_sse():
                break
        for _ in range(100):
            state = (await client.get(sim.url + "/sim/state")).json()
            if state["running"] == 0 and state["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.02)
    assert state["running"] == 0 and state["kv_blocks_used"] == 0
    assert sim.metrics().get("vllm:request_success_total", 0.0) == before


def test_fault_error_rate_and_stall(sim: Sim) -> None:
    """Runtime faults: error_rate=1 gives vLLM-shaped 500s; stall_after_chunks stops a stream but keeps it open."""
    try:
        httpx.post(sim.url + "/sim/faults", json={"error_rate": 1.0}).raise_for_status()
        resp = httpx.post(sim.url + "/v1/chat/completions", json=chat_body("x"))
        assert resp.status_code == 500 and resp.json()["error"]["type"] == "InternalServerError"
        httpx.post(
            sim.url + "/sim/faults", json={"error_rate": 0, "stall_after_chunks": 3}
        ).raise_for_status()
        lines: list[str] = []
        body = chat_body("stall", stream=True, max_tokens=50, ignore_eos=True)
        with (
            pytest.raises(httpx.ReadTimeout),
            httpx.stream(
                "POST",
                sim.url + "/v1/chat/completions",
                json=body,
                timeout=httpx.Timeout(5, read=0.5),
            ) as resp,
        ):
            lines.extend(line for line in resp.iter_lines() if line)
        assert len(lines) == 3
    finally:
        httpx.post(sim.url + "/sim/faults", json={"error_rate": None, "stall_after_chunks": None})
    assert (
        httpx.post(sim.url + "/v1/chat/completions", json=chat_body("x", max_tokens=2)).status_code
        == 200
    )


async def test_kv_preemption_under_tiny_cache(tiny_kv: Sim) -> None:
    """With 20 KV blocks, four growing sequences preempt each other yet all finish in full."""
    body = {"model": "base", "prompt": "p" * 240, "max_tokens": 150, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=30) as client:
        resps = await asyncio.gather(*[
            client.post(tiny_kv.url + "/v1/completions", json={**body, "seed": i}) for i in range(4)
        ])  # fmt: skip
    assert all(r.json()["usage"]["completion_tokens"] == 150 for r in resps)
    m = tiny_kv.metrics()
    assert m["vllm:num_preemptions_total"] > 0
    assert m["vllm:kv_cache_usage_perc"] == 0.0


def test_no_lora_api_without_enable_lora(tiny_kv: Sim) -> None:
    """Without --enable-lora the adapter endpoints are FastAPI's 404 {"detail": "Not Found"}."""
    resp = httpx.post(
        tiny_kv.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}
    )
    assert resp.status_code == 404 and resp.json() == {"detail": "Not Found"}


def test_lmdeploy_flavour(tmp_path: Path) -> None:
    """--flavor lmdeploy: flat errors, role in every chunk, ids "-1", lmdeploy: metrics, no LoRA API, real tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        ["hello world, the simulator speaks"] * 20, trainers.BpeTrainer(vocab_size=300)
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    server = start("--flavor", "lmdeploy", "--model", str(tmp_path), "--max-model-len", "256")
    try:
        missing = httpx.post(
            server.url + "/v1/chat/completions", json={**chat_body("x"), "model": "nope"}
        )
        assert missing.status_code == 404
        assert missing.json()["object"] == "error" and missing.json()["type"] == "not_found_error"
        long = httpx.post(
            server.url + "/v1/completions",
            json={"model": "base", "prompt": "hello " * 400, "stream": True},
        )
        assert long.status_code == 400 and long.json()["type"] == "invalid_request_error"
        stream = httpx.post(
            server.url + "/v1/chat/completions", json=chat_body("hi", stream=True, max_tokens=4)
        )
        chunks = [
            json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")
        ]
        assert all(c["choices"][0]["delta"]["role"] == "assistant" for c in chunks)
        done = httpx.post(
            server.url + "/v1/completions",
            json={"model": "base", "prompt": "hello world", "max_tokens": 2},
        )
        assert done.json()["id"] == "-1"
        assert done.json()["usage"]["prompt_tokens"] == len(
            tok.encode("hello world", add_special_tokens=False).ids
        )
        names = set(server.metrics())
        assert {"lmdeploy:num_requests_running", "lmdeploy:gpu_cache_usage_perc",
                "lmdeploy:prefix_cache_hit_rate", "lmdeploy:generation_tokens_total"} <= names  # fmt: skip
        assert not any(n.startswith("vllm:") for n in names)
        load = SimEngine().parse_metrics(httpx.get(server.url + "/metrics").text)
        assert load.prefix_cache_queries > 0 and load.running == 0
        assert httpx.post(server.url + "/v1/load_lora_adapter", json={}).status_code == 404
    finally:
        server.stop()


def test_fault_die_after() -> None:
    """die_after=2: two requests are served, the third kills the process mid-connection."""
    server = start("--fault", "die_after=2")
    try:
        for _ in range(2):
            assert (
                httpx.post(
                    server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}
                ).status_code
                == 200
            )
        with pytest.raises(httpx.TransportError):
            httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert server.proc.wait(5) == 1
    finally:
        server.stop()


async def test_lora_slots_make_other_adapters_wait(tmp_path: Path) -> None:
    """With one LoRA slot busy, a request for another adapter waits and shows in lora_requests_info."""
    server = start("--max-loras", "1", "--lora-modules", f"a={tmp_path}", f"b={tmp_path}")
    try:
        body = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as client:
            first = asyncio.create_task(
                client.post(server.url + "/v1/completions", json={**body, "model": "a"})
            )
            await asyncio.sleep(0.05)
            second = asyncio.create_task(
                client.post(server.url + "/v1/completions", json={**body, "model": "b"})
            )
            await asyncio.sleep(0.05)
            state = (await client.get(server.url + "/sim/state")).json()
            info = (await client.get(server.url + "/metrics")).text
            await asyncio.gather(first, second)
        assert state["running_lora_adapters"] == ["a"] and state["waiting_lora_adapters"] == ["b"]
        assert 'running_lora_adapters="a",waiting_lora_adapters="b"' in info
        assert first.result().status_code == second.result().status_code == 200
    finally:
        server.stop()
