"""Embeddings and vLLM's tokenizer routes through the gateway, to simulated engines.

A fleet with a generative model and an embedding model (a vLLM-style pooling runner):
each route reaches the engine serving the named model, batches of inputs are judged
input by input against the context length, and bad bodies are 400s naming the field.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import Fleet

GEN = "gen-model"
EMBED = "embed-model"
FAST = ("--option", "time_scale=0.05", "--max-model-len", "512")


@pytest.fixture(scope="module")
def mixed(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("embed"))
    try:
        _, url = fleet.gateway()
        fleet.worker("gen", "--model", GEN, *FAST)
        fleet.worker("embed", "--model", EMBED, *FAST, "--option", "runner=pooling", "--option", "convert=embed")
        fleet.wait_ready(url, "gen", "embed")
        yield fleet, url
    finally:
        fleet.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)


def test_embeddings_reach_the_embedding_model(mixed: tuple[Fleet, str]) -> None:
    _, url = mixed
    raw = _client(url).embeddings.with_raw_response.create(model=EMBED, input=["first text", "second text"])
    assert raw.headers["x-fleetgate-worker"] == "embed"
    result = raw.parse()
    assert [d.index for d in result.data] == [0, 1]
    assert len(result.data[0].embedding) > 0 and result.data[0].embedding != result.data[1].embedding
    assert result.usage.prompt_tokens > 0
    # The openai client asks for base64 by default when numpy is absent or present: both forms work.
    floats = _client(url).embeddings.create(model=EMBED, input="first text", encoding_format="float")
    assert floats.data[0].embedding == result.data[0].embedding


def test_the_embedding_workers_warm_up_was_an_embedding(mixed: tuple[Fleet, str]) -> None:
    """The agent warms a pooling engine up with /v1/embeddings (a completion would fail there)."""
    fleet, _ = mixed
    log = (fleet.tmp / "embed.log").read_text()
    warmups = [line for line in log.splitlines() if "agent.warmup" in line]
    assert warmups and '"status":200' in warmups[0] and '"route":"/v1/embeddings"' in warmups[0], log[-2000:]


def test_a_batch_is_judged_input_by_input_against_the_context(mixed: tuple[Fleet, str]) -> None:
    """64 inputs of ~100 tokens each fit a 512-token context although together they would not;
    one input over it is a 400 before any engine."""
    _, url = mixed
    inputs = [f"document {i} " + "word " * 100 for i in range(64)]
    result = _client(url).embeddings.create(model=EMBED, input=inputs)
    assert len(result.data) == 64
    with pytest.raises(openai.BadRequestError):
        _client(url).embeddings.create(model=EMBED, input=["short", "word " * 3000])


def test_tokenize_and_detokenize_round_trip(mixed: tuple[Fleet, str]) -> None:
    _, url = mixed
    tokens = httpx.post(f"{url}/tokenize", json={"model": GEN, "prompt": "Hello there, router"}, timeout=10)
    assert tokens.status_code == 200, tokens.text
    assert tokens.headers["x-fleetgate-worker"] == "gen"
    body = tokens.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 512
    text = httpx.post(f"{url}/detokenize", json={"model": GEN, "tokens": body["tokens"]}, timeout=10)
    assert text.status_code == 200, text.text
    assert text.json()["prompt"] == "Hello there, router"
    # Any length may be tokenized: a prompt over the context is counted, not refused.
    long = httpx.post(f"{url}/tokenize", json={"model": GEN, "prompt": "word " * 3000}, timeout=10)
    assert long.status_code == 200 and long.json()["count"] > 512


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": EMBED}, "input"),
        ("/v1/embeddings", {"model": EMBED, "input": None}, "input"),
        ("/v1/embeddings", {"input": "x"}, "model"),
        ("/tokenize", {"model": GEN}, "prompt"),
        ("/detokenize", {"tokens": [1]}, "model"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(mixed: tuple[Fleet, str], path: str, body: dict[str, object],
                                              param: str) -> None:
    _, url = mixed
    resp = httpx.post(url + path, json=body, timeout=10)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_asking_a_model_for_what_it_does_not_do_is_a_clear_400(mixed: tuple[Fleet, str]) -> None:
    """Chat with an embedding model, or embeddings from a chat model: the gateway says so
    (the engine itself would answer a bare 404 `Not Found`)."""
    _, url = mixed
    with pytest.raises(openai.BadRequestError) as caught:
        _client(url).chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        _client(url).embeddings.create(model=GEN, input="hi")
    assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "model_not_supported"
    # Either kind tokenizes.
    resp = httpx.post(f"{url}/tokenize", json={"model": EMBED, "prompt": "hi"}, timeout=10)
    assert resp.status_code == 200 and resp.headers["x-fleetgate-worker"] == "embed"


def test_without_the_fast_path_litestar_serves_the_same_routes(mixed: tuple[Fleet, str]) -> None:
    """`fast_path: false`: every proxied route is Litestar's own handler, with the same answers."""
    fleet, _ = mixed
    _, slow = fleet.gateway("--set", "fast_path=false")
    client = _client(slow)
    assert len(client.embeddings.create(model=EMBED, input=["a", "b"]).data) == 2
    response = client.responses.create(model=GEN, input="hi", max_output_tokens=4)
    assert response.output_text
    assert client.completions.create(model=GEN, prompt="hi", max_tokens=2).choices[0].text
    tokens = httpx.post(f"{slow}/tokenize", json={"model": GEN, "prompt": "hi"}, timeout=10)
    assert tokens.status_code == 200 and tokens.json()["count"] > 0
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=GEN, input="hi")


def test_unknown_models_are_404s(mixed: tuple[Fleet, str]) -> None:
    _, url = mixed
    with pytest.raises(openai.NotFoundError):
        _client(url).embeddings.create(model="nope", input="x")
