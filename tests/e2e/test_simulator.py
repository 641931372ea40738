"""The simulator as clients and gateways see it: real processes over loopback."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from httpx_sse import aconnect_sse

from workers.engines.base import AdapterError, EngineSpec
from workers.engines.sim import SimEngine
from workers.simulator.tokens import render_chat

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize(("extra", "tokens"), [({}, 16), ({"max_tokens": None}, 2048 - 4), ({"max_tokens": 3}, 3)])
def test_completion_length_defaults_like_vllm(sim: Sim, extra: dict[str, object], tokens: int) -> None:
    """Without `max_tokens` a completion is 16 tokens (vLLM's default); an explicit null means
    the rest of the context."""
    body = {"model": "base", "prompt": "abcd" * 4, "ignore_eos": True, **extra}
    resp = httpx.post(sim.url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == tokens


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
            async def state_when(ready: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
                """The simulator's state once `ready` holds (a's request running, b's queued):
                the order is set up, not left to two sleeps (on one loaded core b's request
                was sent first)."""
                for _ in range(600):
                    state = (await client.get(server.url + "/sim/state")).json()
                    if ready(state):
                        return state
                    await asyncio.sleep(0.01)
                raise AssertionError(f"never reached: {state}")

            first = asyncio.create_task(
                client.post(server.url + "/v1/completions", json={**body, "model": "a"})
            )
            await state_when(lambda st: st["running_lora_adapters"] == ["a"])
            second = asyncio.create_task(
                client.post(server.url + "/v1/completions", json={**body, "model": "b"})
            )
            state = await state_when(lambda st: st["waiting_lora_adapters"] == ["b"])
            info = (await client.get(server.url + "/metrics")).text
            await asyncio.gather(first, second)
        assert state["running_lora_adapters"] == ["a"] and state["waiting_lora_adapters"] == ["b"]
        # As vLLM 0.32: both labels list every adapter with a request, in arrival order.
        assert 'max_lora="1",running_lora_adapters="a,b",waiting_lora_adapters="a,b"' in info
        assert first.result().status_code == second.result().status_code == 200
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------
# The scheduler's rules, driven step by step on the classes themselves (no sockets, no
# clock): continuous batching, the token budget, KV admission and preemption, the prefix
# cache and LoRA slots.

from workers.simulator.kvcache import BlockPool, block_hashes  # noqa: E402
from workers.simulator.loras import LoraCache  # noqa: E402
from workers.simulator.scheduler import HOST_COPY_SHARE, Limits, Scheduler  # noqa: E402
from workers.simulator.scheduler import Seq as SimSeq  # noqa: E402
from workers.simulator.tokens import TextSource  # noqa: E402
from workers.timing import PROFILES  # noqa: E402


class _Hooks:
    def __init__(self) -> None:
        self.admitted: list[str] = []
        self.first: list[str] = []
        self.finished: list[tuple[str, str]] = []
        self.preempted = 0
        self.lora_loads = 0
        self.lora_disk_loads = 0

    def on_admitted(self, seq: SimSeq, now: float) -> None:
        self.admitted.append(seq.id)

    def on_first_token(self, seq: SimSeq, now: float) -> None:
        self.first.append(seq.id)

    def on_step(self, scheduled: int, sampled: int, gaps: Mapping[float, int]) -> None:
        pass

    def on_finished(self, seq: SimSeq, reason: str, now: float) -> None:
        self.finished.append((seq.id, reason))

    def on_preempted(self) -> None:
        self.preempted += 1

    def on_lora_loads(self, n: int, from_disk: int = 0) -> None:
        self.lora_loads += n
        self.lora_disk_loads += from_disk


class _StepScheduler(Scheduler):
    """The real scheduler with a frozen clock, stepped by hand."""

    @staticmethod
    def _now() -> float:
        return 0.0

    def step(self) -> list[tuple[str, int]]:
        plan = self._schedule()
        self._complete(plan, 0.0)
        return [(s.id, n) for s, n in plan.work]


def _sched(*, seqs: int = 8, budget: int = 512, blocks: int = 64, bs: int = 16,
           loras: int = 2, cpu_loras: int = 0) -> tuple[_StepScheduler, _Hooks]:  # fmt: skip
    hooks = _Hooks()
    limits = Limits(max_num_seqs=seqs, max_num_batched_tokens=budget, num_gpu_blocks=blocks,
                    block_size=bs, max_loras=loras, time_scale=1.0, max_cpu_loras=cpu_loras)  # fmt: skip
    return _StepScheduler(limits, PROFILES["h100-7b"], hooks), hooks


def _seq(sid: str, prompt: int | list[int], out: int = 4, adapter: str | None = None,
         bs: int = 16) -> SimSeq:  # fmt: skip
    ids = list(range(prompt)) if isinstance(prompt, int) else prompt
    return SimSeq(id=sid, prompt_ids=ids, hashes=block_hashes(ids, bs, adapter or ""),
                  source=TextSource(0), target=out, target_reason="length", adapter=adapter)  # fmt: skip


def _submit(s: Scheduler, seq: SimSeq) -> None:
    s.waiting.append(seq)  # submit() without the event loop's clock


def _run_until_done(s: _StepScheduler, limit: int = 500) -> int:
    steps = 0
    while (s.running or s.waiting) and steps < limit:
        s.step()
        steps += 1
    return steps


@pytest.mark.parametrize(
    ("max_seqs", "budget", "prompts", "running", "work"),
    [
        # batch cap: only max_num_seqs sequences run, the rest wait in order
        (2, 4096, [10, 10, 10, 10], 2, [("a", 10), ("b", 10)]),
        # token budget: a long prompt is prefilled in chunks of the budget
        (8, 100, [250], 1, [("a", 100)]),
        # the budget is shared: the second prompt gets what the first left
        (8, 100, [60, 60], 2, [("a", 60), ("b", 40)]),
        # nothing of a later prompt fits once the budget is spent
        (8, 64, [64, 10], 1, [("a", 64)]),
    ],
)
def test_batching_rules(max_seqs: int, budget: int, prompts: list[int], running: int,
                        work: list[tuple[str, int]]) -> None:  # fmt: skip
    """The first step admits FIFO within max_num_seqs and the token budget (chunked prefill)."""
    s, _ = _sched(seqs=max_seqs, budget=budget)
    for sid, n in zip("abcd", prompts, strict=False):
        _submit(s, _seq(sid, [hash((sid, i)) % 50000 for i in range(n)]))
    assert s.step() == work
    assert len(s.running) == running and len(s.waiting) == len(prompts) - running


def test_chunked_prefill_then_one_token_per_step() -> None:
    """A 250-token prompt on a 100-token budget: 3 prefill steps, the first token on the third,
    then one token per step until max_tokens."""
    s, hooks = _sched(budget=100)
    _submit(s, _seq("a", 250, out=3))
    assert [s.step() for _ in range(5)] == [[("a", 100)], [("a", 100)], [("a", 50)], [("a", 1)], [("a", 1)]]
    assert hooks.first == ["a"] and hooks.finished == [("a", "length")]


@pytest.mark.parametrize(
    ("blocks", "prompts", "admitted_first_step"),
    [
        (8, [40, 40], 2),  # 3 + 3 blocks fit in 8
        (5, [40, 40], 1),  # the second waits for free blocks
        (3, [40], 1),      # exactly 3 blocks
    ],
)
def test_kv_admission(blocks: int, prompts: list[int], admitted_first_step: int) -> None:
    """A sequence is admitted only when the blocks for its scheduled tokens are free."""
    s, _ = _sched(blocks=blocks)
    for sid, n in zip("ab", prompts, strict=False):
        _submit(s, _seq(sid, [hash((sid, i)) % 50000 for i in range(n)]))
    s.step()
    assert len(s.running) == admitted_first_step
    assert s.pool.num_used == sum(3 for _ in range(admitted_first_step))
    assert s.pool.usage == pytest.approx(s.pool.num_used / blocks)


def test_preemption_when_blocks_run_out() -> None:
    """Two sequences that outgrow the cache: the later one is preempted (back to the queue
    head, blocks freed, counted), and both still finish with every token."""
    s, hooks = _sched(blocks=6, bs=16)
    a, b = _seq("a", [1] * 30, out=40), _seq("b", [2] * 30, out=40)
    _submit(s, a)
    _submit(s, b)
    _run_until_done(s)
    assert hooks.preempted > 0 and s.preemptions == hooks.preempted
    assert a.generated == b.generated == 40
    assert s.pool.num_used == 0


@pytest.mark.parametrize(
    ("first", "second", "cached"),
    [
        ((list(range(100)), None), (list(range(100)), None), 96),   # same prompt: full blocks, not the last token
        ((list(range(100)), None), (list(range(64)) + [7] * 36, None), 64),  # shared head only
        ((list(range(100)), "x"), (list(range(100)), None), 0),     # another adapter's namespace
        ((list(range(100)), None), (list(range(1, 101)), None), 0),  # different from the first token
        ((list(range(32)), None), (list(range(32)), None), 16),     # a 32-token prompt keeps its last block uncached
    ],
)
def test_prefix_cache_hits(first: tuple[list[int], str | None], second: tuple[list[int], str | None],
                           cached: int) -> None:  # fmt: skip
    """A finished prompt's full blocks serve the next prompt with the same leading blocks,
    within one adapter namespace; hits are whole blocks and never the whole prompt."""
    s, _ = _sched()
    one = _seq("a", first[0], out=1, adapter=first[1])
    _submit(s, one)
    _run_until_done(s)
    two = _seq("b", second[0], out=1, adapter=second[1])
    _submit(s, two)
    s.step()
    assert two.cached_tokens == cached


def test_prefix_cache_lru_eviction() -> None:
    """When free-but-cached blocks are needed, the least recently freed go first, and a
    finished prompt frees its tail before its head: the shared head survives longest."""
    s, _ = _sched(blocks=8, bs=16)
    a_ids, b_ids = list(range(64)), list(range(1000, 1096))
    # a caches 4 blocks; b needs 6 of the 8: the 4 never-hashed ones, then a's last two.
    for sid, ids in (("a", a_ids), ("b", b_ids)):
        _submit(s, _seq(sid, ids, out=1))
        _run_until_done(s)
    again = _seq("a2", a_ids, out=1)
    _submit(s, again)
    s.step()
    assert again.cached_tokens == 32


@pytest.mark.parametrize(
    ("slots", "cpu", "ops", "results", "resident"),
    [
        (2, 0, [("a", ()), ("a", ())], ["disk", "resident"], ["a"]),
        (2, 0, [("a", ()), ("b", ()), ("c", ())], ["disk", "disk", "disk"], ["b", "c"]),
        # using a moves it to the back: b is the least recently used
        (2, 0, [("a", ()), ("b", ()), ("a", ()), ("c", ())], ["disk", "disk", "resident", "disk"], ["a", "c"]),
        # a busy adapter is never evicted; all busy -> None (wait)
        (2, 0, [("a", ()), ("b", ()), ("c", ("a",))], ["disk", "disk", "disk"], ["a", "c"]),
        (2, 0, [("a", ()), ("b", ()), ("c", ("a", "b"))], ["disk", "disk", None], ["a", "b"]),
        # host memory keeps what a slot let go: swapping back in is a copy, not a disk read
        (2, 3, [("a", ()), ("b", ()), ("c", ()), ("a", ())], ["disk", "disk", "disk", "cpu"], ["c", "a"]),
        # host memory full: its least recently used adapter outside the slots is read again
        (1, 2, [("a", ()), ("b", ()), ("c", ()), ("a", ()), ("c", ())],
         ["disk", "disk", "disk", "disk", "cpu"], ["c"]),
    ],
)
def test_lora_slots(slots: int, cpu: int, ops: list[tuple[str, tuple[str, ...]]], results: list[str | None],
                    resident: list[str]) -> None:  # fmt: skip
    """LoRA slots: resident is free, a miss takes the least recently used idle slot, from host
    memory when it holds the adapter (max_cpu_loras), else from disk."""
    lru = LoraCache(slots, cpu)
    assert [lru.acquire(name, set(busy)) for name, busy in ops] == results
    assert lru.resident == resident
    assert len(lru.in_host) <= max(cpu, slots)


def test_pinned_adapters_never_load_nor_take_a_slot() -> None:
    """LMDeploy's start-time adapters: resident from the start, never evicted, never counted
    as a load, and the runtime slots stay for the others."""
    lru = LoraCache(1, pinned=("p", "q"))
    assert lru.resident == ["p", "q"]
    assert [lru.acquire(n, set()) for n in ["p", "q", "a", "p", "b"]] == [
        "resident", "resident", "disk", "resident", "disk"]
    assert lru.resident == ["p", "q", "b"]


def test_waiting_adapter_over_max_loras_is_skipped_without_fairness() -> None:
    """vLLM's rule: with a and b running on two slots, a waiting c is skipped, and the a and b
    requests queued behind it pass it, step after step, until a slot's adapter has nothing
    running; lora_requests_info lists every adapter with a request, in arrival order."""
    s, _ = _sched(loras=2)
    for sid, adapter in [("a1", "a"), ("b1", "b")]:
        s._enqueue(_seq(sid, [1] * 20, out=6, adapter=adapter))
    s.step()
    c = _seq("c1", [2] * 20, out=1, adapter="c")
    s._enqueue(c)
    s._enqueue(_seq("a2", [3] * 20, out=3, adapter="a"))
    s._enqueue(_seq("b2", [4] * 20, out=6, adapter="b"))
    work = s.step()
    assert ("a2", 20) in work and ("b2", 20) in work and c.status == "waiting"
    assert c in s.deferred
    s._publish()
    assert s.published.lora_adapters == ("a", "b", "c") and s.published.deferred == 1
    # a's last request finishes first: its slot goes to c
    while c.status == "waiting":
        s.step()
    assert {x.adapter for x in s.running} <= {"b", "c"}
    _run_until_done(s)
    s._publish()
    assert s.published.lora_adapters == () and not s.deferred


def test_host_memory_makes_swaps_cheap() -> None:
    """With max_cpu_loras above the slots an adapter swapped back in is copied from host memory:
    counted as a slot load, not a disk read, and timed HOST_COPY_SHARE of lora_load_s."""
    s, hooks = _sched(loras=1, cpu_loras=4)
    for i, name in enumerate(["a", "b", "a"]):
        _submit(s, _seq(f"r{i}", [i] * 20, out=1, adapter=name))
        _run_until_done(s)
    assert (hooks.lora_loads, hooks.lora_disk_loads) == (3, 2)
    _submit(s, _seq("x", [9] * 20, out=1, adapter="b"))
    plan = s._schedule()
    assert (plan.lora_loads, plan.lora_disk_loads) == (1, 0)
    p = s.profile
    expected = p.lora_step(p.base_step_s + 20 * p.prefill_per_token_s) + HOST_COPY_SHARE * p.lora_load_s
    assert s._step_seconds(plan) == pytest.approx(expected)


def test_lora_swaps_counted_and_timed() -> None:
    """Alternating three adapters over two slots loads on every miss; each load adds
    lora_load_s to its step, and a running adapter's slot is not taken."""
    s, hooks = _sched(loras=2)
    for i, name in enumerate(["a", "b", "a", "c", "b"]):
        _submit(s, _seq(f"r{i}", [i] * 20, out=1, adapter=name))
        _run_until_done(s)
    # a, b load; a resident; c evicts b (LRU); b evicts a
    assert hooks.lora_loads == 4
    p = s.profile
    plan = s._schedule()  # nothing left: no work
    assert not plan.work
    _submit(s, _seq("x", [9] * 20, out=1, adapter="d"))
    plan = s._schedule()
    assert plan.lora_loads == 1
    expected = p.lora_step(p.base_step_s + 20 * p.prefill_per_token_s) + p.lora_load_s
    assert s._step_seconds(plan) == pytest.approx(expected)


@pytest.mark.parametrize(("decoding", "prefill"), [(0, 100), (1, 0), (32, 0), (8, 512)])
def test_step_time(decoding: int, prefill: int) -> None:
    """Step time = base + per decoding sequence + per uncached prompt token, times time_scale."""
    s, _ = _sched(seqs=64, budget=8192, blocks=4096)
    seqs = [_seq(f"d{i}", [i] * 5, out=50) for i in range(decoding)]
    for q in seqs:
        _submit(s, q)
    s.step()  # their prefill
    if prefill:
        _submit(s, _seq("p", [77] * prefill, out=1))
    plan = s._schedule()
    p = s.profile
    assert s._step_seconds(plan) == pytest.approx(
        p.base_step_s + p.decode_per_seq_s * decoding + p.prefill_per_token_s * prefill
    )


@pytest.mark.parametrize(("decoding", "f_tok"), [(1, 0.0), (1, 0.0002), (8, 0.0002), (32, 0.001)])
def test_frontend_token_cost_delays_the_next_step(decoding: int, f_tok: float) -> None:
    """Each token a step samples costs the shared CPU frontend_per_token_s, paid by the next
    step (detokenize + SSE chunk run while it computes); zero on GPU profiles."""
    s, _ = _sched(seqs=64, budget=8192, blocks=4096)
    s.profile = replace(s.profile, frontend_per_token_s=f_tok)
    for i in range(decoding):
        _submit(s, _seq(f"d{i}", [i] * 5, out=50))
    s.step()  # prefill: every sequence samples its first token
    assert s.frontend.take_debt() == pytest.approx(decoding * f_tok)
    assert s.frontend.take_debt() == 0.0  # paid once
    assert PROFILES["h100-7b"].frontend_per_token_s == 0.0


@pytest.mark.parametrize(
    ("f_req", "arrivals", "busy", "ready", "debt"),
    [
        # one at a time: three at once are admitted f_req apart
        (0.01, 3, False, [0.01, 0.02, 0.03], 0.0),
        # the same while the engine runs: each admission also takes f_req from its step
        (0.01, 2, True, [0.01, 0.02], 0.02),
        # no front-end cost: straight into the queue
        (0.0, 2, False, [0.0, 0.0], 0.0),
    ],
)
async def test_frontend_admission(f_req: float, arrivals: int, busy: bool, ready: list[float],
                                  debt: float) -> None:  # fmt: skip
    """A request is schedulable only once the front-end has admitted it, one request at a
    time; admissions while the engine is busy delay its next step by as much."""
    hooks = _Hooks()
    limits = Limits(max_num_seqs=8, max_num_batched_tokens=512, num_gpu_blocks=64,
                    block_size=16, max_loras=0, time_scale=1.0)  # fmt: skip
    s = Scheduler(limits, replace(PROFILES["cpu-tiny"], frontend_per_request_s=f_req), hooks)
    if busy:
        s.running.append(_seq("busy", 5))
    loop = asyncio.get_running_loop()
    seen: dict[str, float] = {}
    enqueue = s._enqueue

    def record(seq: SimSeq) -> None:
        seen[seq.id] = loop.time() - t0
        enqueue(seq)

    s._enqueue = record  # type: ignore[method-assign]
    t0 = loop.time()
    for i in range(arrivals):
        s.submit(_seq(f"r{i}", 5))
    assert s.frontend.debt == pytest.approx(debt)
    if f_req:
        with pytest.raises(RuntimeError):  # requests in the front-end count as busy
            s.reset()
    await asyncio.sleep(ready[-1] + 0.6)
    got = [seen[f"r{i}"] for i in range(arrivals)]
    # Never before its admission time (one front-end slot at a time); late only by the event
    # loop's own delay (generous: a loaded CI machine's loop can run tens of ms behind).
    for i, (g, r) in enumerate(zip(got, ready, strict=True)):
        assert r - 0.002 <= g <= r + 0.5, (i, got, ready)
    assert [q.id for q in s.waiting] == [f"r{i}" for i in range(arrivals)]


async def test_abort_while_in_the_frontend() -> None:
    """A client that leaves before admission never reaches the engine's queue."""
    limits = Limits(max_num_seqs=8, max_num_batched_tokens=512, num_gpu_blocks=64,
                    block_size=16, max_loras=0, time_scale=1.0)  # fmt: skip
    s = Scheduler(limits, replace(PROFILES["cpu-tiny"], frontend_per_request_s=0.01), _Hooks())
    seq = _seq("gone", 5)
    s.submit(seq)
    s.abort(seq)
    assert seq.status == "aborted" and not s.frontend.admitting
    await asyncio.sleep(0.03)
    assert not s.waiting
    s.reset()


def test_reset_clears_cache_and_slots_only_when_idle() -> None:
    """reset() empties the prefix cache and the LoRA slots, and refuses while work is queued."""
    s, _ = _sched()
    _submit(s, _seq("a", list(range(100)), out=1, adapter="x"))
    _run_until_done(s)
    assert s.loras.resident == ["x"]
    _submit(s, _seq("busy", [1] * 10))
    with pytest.raises(RuntimeError):
        s.reset()
    _run_until_done(s)
    s.reset()
    assert s.loras.resident == [] and s.pool.num_used == 0
    again = _seq("b", list(range(100)), out=1, adapter="x")
    _submit(s, again)
    s.step()
    assert again.cached_tokens == 0


def test_block_pool_refcounts() -> None:
    """Shared blocks are counted once per user and become evictable only when the last leaves."""
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.register(blocks[0], 111)
    pool.touch([blocks[0]])  # a second user
    pool.release(blocks)
    assert pool.num_used == 1  # blocks[0] still held by the second user
    pool.release([blocks[0]])
    assert pool.num_used == 0 and pool.lookup([111], 1) == [blocks[0]]


def test_http_reset_and_lora_load_counter(tmp_path: Path) -> None:
    """POST /sim/reset: the next identical prompt misses the prefix cache, and
    fleetgate_sim:lora_loads_total counts slot loads (again after the reset)."""
    server = start("--max-loras", "1", "--lora-modules", f"a={tmp_path}")
    try:
        body = {"model": "a", "prompt": "shared prefix " * 40, "max_tokens": 1}
        url = server.url + "/v1/completions"
        assert httpx.post(url, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert httpx.post(url, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert server.metrics()["fleetgate_sim:lora_loads_total"] == 1
        assert httpx.post(server.url + "/sim/reset").json()["ok"] is True
        assert httpx.post(url, json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert server.metrics()["fleetgate_sim:lora_loads_total"] == 2
    finally:
        server.stop()


def test_http_profile_timing_fields_at_run_time() -> None:
    """POST /sim/profile changes timing fields of the running engine (and only those);
    the next requests run at the new speed."""
    server = start("--profile", "cpu-tiny", "--time-scale", "1")
    try:
        url = server.url + "/sim/profile"
        assert httpx.get(url).json()["frontend_per_token_s"] > 0
        body = {"model": "base", "prompt": "x " * 20, "max_tokens": 20, "ignore_eos": True}
        got = httpx.post(url, json={"base_step_s": 0.02, "frontend_per_token_s": 0}).json()
        assert got["base_step_s"] == 0.02 and got["frontend_per_token_s"] == 0
        t0 = time.perf_counter()
        httpx.post(server.url + "/v1/completions", json=body)
        assert time.perf_counter() - t0 >= 20 * 0.02
        bad_bodies: list[Any] = [{"num_gpu_blocks": 3}, {"base_step_s": -1}, {"base_step_s": "x"}, []]
        for bad in bad_bodies:
            assert httpx.post(url, json=bad).status_code == 400
    finally:
        server.stop()

