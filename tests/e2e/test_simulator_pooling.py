"""The simulator's pooling runner (/v1/embeddings) and /tokenize, /detokenize against real
vLLM 0.32 captures (tests/data/vllm_pooling/).

Each simulator runs as a real process on loopback, served as `tiny` with --max-model-len
2048 like the captured vLLM, so error messages can be compared byte for byte. The pooling
simulator reads the tiny model's folder when `make tiny` has made it (its tokenizer and
hidden size), else a folder holding only a config.json with the same hidden size.
"""

from __future__ import annotations

import base64
import json
import math
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.test_simulator import FAST, Sim, free_port
from tests.e2e.test_simulator_responses import keys
from workers.simulator.__main__ import config_from_args
from workers.simulator.tokens import default_system

CAPTURES = Path(__file__).resolve().parents[1] / "data" / "vllm_pooling"
TINY = Path(__file__).resolve().parents[2] / ".cache" / "tiny" / "model"
DIM = 128  # the tiny model's hidden_size, and what vLLM returned


def capture(name: str) -> tuple[int, Any]:
    """(status, JSON body) of a captured `curl -i` answer."""
    head, _, body = (CAPTURES / name).read_text().replace("\r\n", "\n").partition("\n\n")
    return int(head.split()[1]), json.loads(body)


def start(*args: str) -> Sim:
    port = free_port()
    argv = [sys.executable, "-m", "workers.simulator", "--port", str(port),
            "--served-model-name", "tiny", "--max-model-len", "2048", "--block-size", "16",
            "--time-scale", FAST, *args]  # fmt: skip
    return Sim(argv, port)


def model_dir(tmp: Path, config: dict[str, Any]) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(config))
    return str(tmp)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    folder = (
        str(TINY)
        if TINY.is_dir()
        else model_dir(tmp_path_factory.mktemp("m"), {"hidden_size": DIM})
    )
    server = start("--model", folder, "--runner", "pooling", "--convert", "embed")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gen() -> Iterator[Sim]:
    server = start("--model", str(TINY)) if TINY.is_dir() else start()
    yield server
    server.stop()


def needs_tiny() -> None:
    if not TINY.is_dir():
        pytest.skip("the tiny model's tokenizer is missing; run `make tiny`")


def embed(sim: Sim, **body: Any) -> httpx.Response:
    return httpx.post(sim.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=30)


def test_openai_client_float_and_base64(pool: Sim) -> None:
    """The official client gets unit vectors of the model's size, equal as floats or base64 (its default, which it decodes)."""
    api = openai.OpenAI(base_url=pool.url + "/v1", api_key="x", max_retries=0)
    inputs = ["Hello world", "Second input"]
    floats = api.embeddings.create(model="tiny", input=inputs, encoding_format="float")
    decoded = api.embeddings.create(model="tiny", input=inputs)  # asks for base64, decodes
    packed = api.embeddings.create(model="tiny", input=inputs, encoding_format="base64")
    assert [d.index for d in floats.data] == [0, 1] and floats.model == "tiny"
    for a, b, c in zip(floats.data, decoded.data, packed.data, strict=True):
        assert len(a.embedding) == DIM
        assert math.isclose(sum(x * x for x in a.embedding), 1.0, rel_tol=1e-5)
        assert a.embedding == b.embedding  # float32 both ways
        raw = base64.b64decode(str(c.embedding))
        assert list(struct.unpack(f"<{DIM}f", raw)) == a.embedding
    assert floats.data[0].embedding != floats.data[1].embedding
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    again = api.embeddings.create(model="tiny", input="Hello world", encoding_format="float")
    assert again.data[0].embedding == floats.data[0].embedding  # deterministic


SHAPES = [
    ({"input": "Hello world"}, "pool-embed-str.txt"),
    ({"input": ["Hello world", "Second input here"]}, "pool-embed-list.txt"),
    ({"input": [42, 1674, 334]}, "pool-embed-ids.txt"),
    ({"input": [[42, 1674], [334, 1253, 544]]}, "pool-embed-ids-list.txt"),
    ({"input": "Hello world", "encoding_format": "base64"}, "pool-embed-base64.txt"),
    ({"messages": [{"role": "user", "content": "Hi there"}]}, "pool-embed-messages.txt"),
]


@pytest.mark.parametrize(("body", "name"), SHAPES)
def test_response_shape_matches_vllm(pool: Sim, body: dict[str, Any], name: str) -> None:
    """Each input form answers vLLM's keys in vLLM's order, one item per input, with its usage shape."""
    resp = embed(pool, **body)
    status, theirs = capture(name)
    ours = resp.json()
    assert resp.status_code == status == 200
    assert list(keys(ours).items()) == list(keys(theirs).items())
    assert ours["id"].startswith("embd-") and ours["object"] == "list"
    assert len(ours["data"]) == len(theirs["data"])
    assert [list(d) for d in ours["data"]] == [list(d) for d in theirs["data"]]
    assert (
        ours["usage"].keys() == theirs["usage"].keys() and ours["usage"]["completion_tokens"] == 0
    )
    if isinstance(theirs["data"][0]["embedding"], str):
        assert len(base64.b64decode(ours["data"][0]["embedding"])) == 4 * DIM
    else:
        assert len(ours["data"][0]["embedding"]) == len(theirs["data"][0]["embedding"]) == DIM


def test_usage_counts_tokens_like_vllm(pool: Sim) -> None:
    """With the tiny model's tokenizer the prompt tokens are vLLM's own."""
    needs_tiny()
    for name, body in (("pool-embed-str.txt", {"input": "Hello world"}),
                       ("pool-embed-list.txt", {"input": ["Hello world", "Second input here"]})):  # fmt: skip
        assert embed(pool, **body).json()["usage"] == capture(name)[1]["usage"]


def test_request_id_header_names_the_response(pool: Sim) -> None:
    """As in vLLM, X-Request-Id becomes the id after `embd-`."""
    resp = httpx.post(
        pool.url + "/v1/embeddings", json={"input": "Hi"}, headers={"X-Request-Id": "abc123"}
    )
    assert resp.json()["id"] == "embd-abc123"


def test_truncate_keeps_the_first_tokens(pool: Sim) -> None:
    """truncate_prompt_tokens keeps the first N tokens (vLLM's right-side truncation)."""
    cut = embed(pool, input=[42, 1674, 334, 1253, 544], truncate_prompt_tokens=3).json()
    whole = embed(pool, input=[42, 1674, 334]).json()
    assert cut["data"][0]["embedding"] == whole["data"][0]["embedding"]
    assert cut["usage"]["prompt_tokens"] == 3


def test_bytes_encoding(pool: Sim) -> None:
    """encoding_format bytes: raw float32 vectors and a `metadata` header, as vLLM's."""
    resp = embed(pool, input=["Hi", "there"], encoding_format="bytes")
    theirs = (CAPTURES / "pool-embed-bytes.txt").read_text()
    assert resp.headers["content-type"] == "application/octet-stream"
    meta = json.loads(resp.headers["metadata"])
    their_meta = json.loads(theirs.split("metadata: ", 1)[1].splitlines()[0])
    assert list(keys(meta).items()) == list(keys(their_meta).items())
    assert [(d["start"], d["end"], d["shape"]) for d in meta["data"]] == [
        (0, 4 * DIM, [DIM]),
        (4 * DIM, 8 * DIM, [DIM]),
    ]
    floats = embed(pool, input=["Hi", "there"]).json()["data"]
    assert list(struct.unpack(f"<{DIM}f", resp.content[: 4 * DIM])) == floats[0]["embedding"]


def _ids(n: int) -> list[int]:
    return [5] * n


ERRORS = [
    ({"input": "Hi", "dimensions": 64}, "pool-embed-dimensions.txt", True),
    ({"input": []}, "pool-embed-empty-list.txt", True),
    ({"input": ""}, "pool-embed-empty-str.txt", True),
    ({"input": 5}, "pool-embed-bad-input.txt", False),
    ({}, "pool-embed-missing-input.txt", False),
    ({"input": "Hi", "encoding_format": "hex"}, "pool-embed-bad-format.txt", False),
    ({"input": _ids(2049)}, "pool-embed-toolong-ids.txt", True),
    ({"input": "hello world " * 1500}, "pool-embed-toolong-text.txt", True),
    ({"input": "Hi", "truncate_prompt_tokens": 5000}, "pool-embed-truncate-big.txt", True),
    ({"model": "nope", "input": "Hi"}, "pool-embed-unknown-model.txt", True),
]  # fmt: skip


@pytest.mark.parametrize(("body", "name", "same_message"), ERRORS)
def test_errors_match_vllm(pool: Sim, body: dict[str, Any], name: str, same_message: bool) -> None:
    """Bad embedding requests get vLLM's status, error type and param (and message, where it is not pydantic's list)."""
    resp = httpx.post(pool.url + "/v1/embeddings", json={"model": "tiny", **body}, timeout=30)
    status, theirs = capture(name)
    ours = resp.json()
    assert resp.status_code == status
    assert (ours["error"]["type"], ours["error"]["param"], ours["error"]["code"]) == (
        theirs["error"]["type"], theirs["error"]["param"], theirs["error"]["code"])  # fmt: skip
    if same_message:
        assert ours == theirs


def test_prompt_at_the_limit_is_fine_and_unknown_ids_are_refused(pool: Sim) -> None:
    """2048 ids embed (pooling needs no room for output); ids outside the vocabulary are vLLM's 400."""
    assert embed(pool, input=_ids(2048)).status_code == 200
    needs_tiny()
    resp = embed(pool, input=[42, 99999])
    assert (resp.status_code, resp.json()) == capture("pool-embed-oov-ids.txt")


def test_matryoshka_dimensions(tmp_path: Path) -> None:
    """A Matryoshka model's config allows `dimensions` among its sizes: a shorter unit vector; others are vLLM's 400."""
    folder = model_dir(tmp_path / "mat", {"hidden_size": 64, "matryoshka_dimensions": [16, 32, 64]})
    sim = start("--model", folder, "--convert", "embed")
    try:
        short = embed(sim, input="Hi", dimensions=32).json()["data"][0]["embedding"]
        assert len(short) == 32 and math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-5)
        assert len(embed(sim, input="Hi").json()["data"][0]["embedding"]) == 64
        bad = embed(sim, input="Hi", dimensions=20).json()["error"]
        assert (
            bad["message"]
            == "Model 'tiny' only supports Matryoshka dimensions [16, 32, 64], got 20."
        )
    finally:
        sim.stop()


ROUTES = [
    ("pool", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "pool-chat.txt"),
    ("pool", "/v1/completions", {"prompt": "Hi"}, "pool-completions.txt"),
    ("pool", "/v1/responses", {"input": "Hi"}, "pool-responses.txt"),
    ("gen", "/v1/embeddings", {"input": "Hello world"}, "gen-embeddings.txt"),
]  # fmt: skip


@pytest.mark.parametrize(("which", "path", "body", "name"), ROUTES)
def test_other_runners_routes_are_404(request: pytest.FixtureRequest, which: str, path: str,
                                      body: dict[str, Any], name: str) -> None:  # fmt: skip
    """A pooling model has no generation routes and a generative one no embeddings route: vLLM's plain 404."""
    sim: Sim = request.getfixturevalue(which)
    resp = httpx.post(sim.url + path, json={"model": "tiny", **body})
    assert (resp.status_code, resp.json()) == capture(name)


def test_models_unchanged_in_pooling_mode(pool: Sim) -> None:
    """/v1/models lists the model as in generate mode, with vLLM's keys."""
    ours = httpx.get(pool.url + "/v1/models").json()
    assert keys(ours) == keys(capture("pool-models.txt")[1])


def test_metrics_count_an_embedding_batch(pool: Sim) -> None:
    """Each input counts as one request finished with "stop": its prompt tokens, TTFT, no generated tokens; a repeat hits the prefix cache."""
    batch = [[7] * 300, [8] * 200, [9] * 10]
    before = pool.metrics()
    assert embed(pool, input=batch).json()["usage"]["prompt_tokens"] == 510
    mid = pool.metrics()
    embed(pool, input=batch)
    after = pool.metrics()

    def delta(a: dict[str, float], b: dict[str, float], name: str) -> float:
        return b.get(name, 0.0) - a.get(name, 0.0)

    assert delta(before, mid, "vllm:prompt_tokens_total") == 510
    assert delta(before, mid, "vllm:prefix_cache_queries_total") == 510
    assert delta(before, mid, "vllm:request_success_total") == 3
    assert delta(before, mid, "vllm:time_to_first_token_seconds_count") == 3
    assert delta(before, mid, "vllm:generation_tokens_total") == 0
    hits = sum((len(p) - 1) // 16 * 16 for p in batch)  # full 16-token blocks
    assert delta(mid, after, "vllm:prefix_cache_hits_total") == hits
    assert delta(mid, after, "vllm:prompt_tokens_total") == 510  # cached tokens count too
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0


def test_embedding_requests_queue_for_batch_slots() -> None:
    """With max_num_seqs 1 and slow steps, concurrent embedding requests wait in the queue and finish one by one."""
    step = 0.5
    sim = start("--runner", "pooling", "--max-num-seqs", "1", "--time-scale", "1",
                "--profile-param", f"base_step_s={step}")  # fmt: skip
    try:
        # All four requests are in the engine's sockets before it reads one (it is stopped
        # meanwhile), so they arrive together however slowly this machine starts threads.
        body = json.dumps({"model": "tiny", "input": "request"}).encode()
        head = (f"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
        port = int(sim.url.rsplit(":", 1)[1])
        os.kill(sim.proc.pid, signal.SIGSTOP)
        try:
            socks = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(4)]
            for sock in socks:
                sock.sendall(head + body)
        finally:
            os.kill(sim.proc.pid, signal.SIGCONT)
        done: list[float] = []
        t0 = time.monotonic()

        def one(sock: socket.socket) -> None:
            with sock:
                answer = b"".join(iter(lambda: sock.recv(65536), b""))
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            done.append(time.monotonic() - t0)

        threads = [threading.Thread(target=one, args=(sock,)) for sock in socks]
        for t in threads:
            t.start()
        waiting = 0.0
        while any(t.is_alive() for t in threads):
            waiting = max(waiting, sim.metrics().get("vllm:num_requests_waiting", 0.0))
            time.sleep(0.02)
        for t in threads:
            t.join()
        assert waiting >= 2
        assert len(done) == 4 and max(done) >= 4 * step * 0.9  # one step each, serially
        assert sim.metrics()["vllm:request_queue_time_seconds_sum"] > step
    finally:
        sim.stop()


def test_tokenize_and_detokenize_shapes(pool: Sim, gen: Sim) -> None:
    """/tokenize and /detokenize answer vLLM's shapes in both runners and round-trip."""
    for sim in (pool, gen):
        plain = httpx.post(
            sim.url + "/tokenize", json={"model": "tiny", "prompt": "Hello world, tokens!"}
        ).json()
        assert list(plain) == list(capture("gen-tokenize.txt")[1]) and plain["token_strs"] is None
        assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 2048
        strs = httpx.post(
            sim.url + "/tokenize",
            json={"prompt": "Hello world, tokens!", "return_token_strs": True},
        ).json()
        assert len(strs["token_strs"]) == strs["count"]
        back = httpx.post(
            sim.url + "/detokenize", json={"model": "tiny", "tokens": plain["tokens"]}
        ).json()
        assert back == capture("gen-detokenize.txt")[1]


def test_tokenize_matches_vllm_with_the_tiny_tokenizer(gen: Sim) -> None:
    """With the model's tokenizer.json the ids and token strings are vLLM's."""
    needs_tiny()
    for name, body in (("gen-tokenize-strs.txt", {"prompt": "Hello world, tokens!", "return_token_strs": True}),
                       ("gen-tokenize-special.txt", {"prompt": "<|im_start|>user", "add_special_tokens": False,
                                                     "return_token_strs": True})):  # fmt: skip
        assert (
            httpx.post(gen.url + "/tokenize", json={"model": "tiny", **body}).json()
            == capture(name)[1]
        )
    oov = httpx.post(gen.url + "/detokenize", json={"model": "tiny", "tokens": [42, 99999]})
    assert (oov.status_code, oov.json()) == capture("gen-detokenize-oov.txt")


def test_chat_prompt_carries_the_templates_default_system(gen: Sim) -> None:
    """With the tiny model's folder, a chat without a system message gets the one its chat
    template adds, as in vLLM: /tokenize answers the captured ids, and chat usage counts
    vLLM's 28 prompt tokens for "Hi" (vLLM 0.32 on the tiny model, 2026-12-06)."""
    needs_tiny()
    hi_there = [{"role": "user", "content": "Hi there"}]
    for name, extra in (("gen-tokenize-chat.txt", {}),
                        ("gen-tokenize-noprompt-gen.txt", {"add_generation_prompt": False})):  # fmt: skip
        body = {"model": "tiny", "messages": hi_there, **extra}
        assert httpx.post(gen.url + "/tokenize", json=body).json() == capture(name)[1]
    chat = httpx.post(gen.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})  # fmt: skip
    assert chat.json()["usage"]["prompt_tokens"] == 28
    own = [{"role": "system", "content": "Be brief."}, *hi_there]
    counted = httpx.post(gen.url + "/tokenize", json={"model": "tiny", "messages": own}).json()
    assert "You are a helpful" not in httpx.post(
        gen.url + "/detokenize", json={"model": "tiny", "tokens": counted["tokens"]}
    ).json()["prompt"]


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"chat_template.jinja": "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"},
         "You are a helpful assistant."),
        # Qwen2.5's: in tokenizer_config.json, the default in an else branch
        ({"tokenizer_config.json": json.dumps({"chat_template": "{%- if messages[0]['role'] == 'system' %}"
          "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
          "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud.<|im_end|>\\n' }}{%- endif %}"})},
         "You are Qwen, created by Alibaba Cloud."),
        # named templates: the default one
        ({"tokenizer_config.json": json.dumps({"chat_template": [
            {"name": "tool_use", "template": "{{ '<|im_start|>system\\nTools<|im_end|>\\n' }}"},
            {"name": "default", "template": "{{ '<|im_start|>system\\nDefault.<|im_end|>\\n' }}"}]})},
         "Default."),
        # a system turn only from the messages: no default
        ({"chat_template.jinja": "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"}, None),
        ({}, None),
    ],
)  # fmt: skip
def test_default_system_read_from_the_chat_template(tmp_path: Path, files: dict[str, str],
                                                    expected: str | None) -> None:  # fmt: skip
    """The default system message is a literal ChatML system turn of the template."""
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert default_system(tmp_path) == expected


TOKENIZER_ERRORS = [
    ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True,
                   "continue_final_message": True}, "gen-tokenize-chat-both.txt", True),
    ("/tokenize", {"model": "tiny"}, "gen-tokenize-empty.txt", True),
    ("/tokenize", {"model": "nope", "prompt": "Hi"}, "gen-tokenize-unknown-model.txt", False),
    ("/detokenize", {"model": "tiny", "tokens": [-1]}, "gen-detokenize-negative.txt", True),
    ("/detokenize", {"model": "tiny"}, "gen-detokenize-missing.txt", True),
    ("/detokenize", {"model": "nope", "tokens": [42]}, "gen-detokenize-unknown-model.txt", False),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "name", "same_message"), TOKENIZER_ERRORS)
def test_tokenizer_errors_match_vllm(
    gen: Sim, path: str, body: dict[str, Any], name: str, same_message: bool
) -> None:
    """Tokenizer errors carry vLLM's status, type and param (and message where the simulator can know it)."""
    resp = httpx.post(gen.url + path, json=body)
    status, theirs = capture(name)
    assert resp.status_code == status
    ours = resp.json()["error"]
    assert (ours["type"], ours["param"]) == (theirs["error"]["type"], theirs["error"]["param"])
    if same_message:
        assert ours == theirs["error"]


def test_lmdeploy_has_no_embeddings_or_tokenizer_routes() -> None:
    """LMDeploy's flavour answers its plain 404 for /v1/embeddings and /tokenize."""
    sim = start("--flavor", "lmdeploy")
    try:
        for path in ("/v1/embeddings", "/tokenize", "/detokenize"):
            resp = httpx.post(sim.url + path, json={"model": "tiny", "input": "Hi"})
            assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"})
    finally:
        sim.stop()


@pytest.mark.parametrize(("argv", "runner"), [
    ([], "generate"),
    (["--runner", "pooling"], "pooling"),
    (["--convert", "embed"], "pooling"),
    (["--runner", "pooling", "--convert", "embed"], "pooling"),
    (["--runner", "generate"], "generate"),
])  # fmt: skip
def test_runner_flags_resolve_like_vllm(argv: list[str], runner: str) -> None:
    """--runner/--convert take vLLM's names; --convert embed alone implies the pooling runner."""
    assert config_from_args(["--served-model-name", "m", *argv]).runner == runner


@pytest.mark.parametrize("argv", [
    ["--runner", "pooling", "--convert", "none"],
    ["--runner", "generate", "--convert", "embed"],
    ["--runner", "pooling", "--flavor", "lmdeploy"],
])  # fmt: skip
def test_runner_flag_conflicts_are_refused(argv: list[str]) -> None:
    """Combinations vLLM (or LMDeploy) cannot serve stop the simulator at start."""
    with pytest.raises(SystemExit):
        config_from_args(["--served-model-name", "m", *argv])
