"""Context length with a real tokenizer: prompts whose tokens the gateway's byte estimate
undercounts still reach a worker whose context fits them.

The simulators tokenize with the tiny model's tokenizer.json (built by `make vllm`), as the
real engine would; the gateway is given no tokenizer, so it only estimates.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import openai
import pytest

from gateway.request.context import refused_prompt_tokens
from tests.conftest import ROOT, Fleet, require_setup

TINY = ROOT / ".cache" / "tiny" / "model"
# About 3.9 KB of Chinese: ~1,000 tokens by the 4-bytes rule, ~4,000 by the tiny model's
# byte-level tokenizer, which has no Chinese merges.
SENTENCE = "我们在这里讨论机器学习模型的上下文长度问题以及网关如何正确地计算令牌数量。"


@pytest.fixture
def two_contexts(fleet_factory: Callable[[], Fleet]) -> tuple[Fleet, str, str]:
    require_setup("tokenizer", [TINY / "tokenizer.json"], "vllm", "FLEETGATE_REQUIRE_VLLM")
    fleet = fleet_factory()
    gateway, url = fleet.gateway()
    for wid, length in (("small", 2048), ("big", 16384)):
        fleet.worker(wid, "--model", str(TINY), "--max-model-len", str(length), "--option", "time_scale=0.05")
    fleet.wait_ready(url, "small", "big")
    return fleet, url, gateway.log_path.read_text


def test_long_chinese_prompts_land_where_they_fit(two_contexts: tuple[Fleet, str, Callable[[], str]]) -> None:
    """16 different 3.9 KB Chinese prompts, whole and streamed: every one is answered (by the
    16k worker), none gets the 2k worker's context-length 400."""
    _, url, gateway_log = two_contexts
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    served = []
    for i in range(16):
        messages = [{"role": "system", "content": f"助手编号 {i}。"},
                    {"role": "user", "content": SENTENCE * 35}]
        if i % 2:
            raw = client.chat.completions.with_raw_response.create(
                model="model", messages=messages, max_tokens=8, stream=True)  # type: ignore[arg-type]
            chunks = list(raw.parse())
            assert any(c.choices and c.choices[0].finish_reason for c in chunks)
        else:
            raw = client.chat.completions.with_raw_response.create(
                model="model", messages=messages, max_tokens=8)  # type: ignore[arg-type]
            assert raw.parse().usage.prompt_tokens > 2048  # type: ignore[union-attr]
        served.append(raw.headers["x-fleetgate-worker"])
    assert served == ["big"] * 16
    refused = gateway_log().count("gateway.context_refused")
    print(f"context: 16/16 answered on the 16k worker, {refused} refused first by the 2k worker")


def test_a_prompt_too_long_for_every_worker_gets_the_engines_400(
    two_contexts: tuple[Fleet, str, Callable[[], str]],
) -> None:
    """Over 16k tokens by the tokenizer (but not by the estimate): the 400 says so, in OpenAI's shape."""
    _, url, _ = two_contexts
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="model", max_tokens=8,
                                       messages=[{"role": "user", "content": SENTENCE * 160}])
    assert "maximum context length is" in caught.value.message


@pytest.mark.parametrize(("message", "tokens"), [
    # vLLM 0.32, as captured in tests/data/vllm_responses/nostore-toolong.txt
    ("This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 input "
     "tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input "
     "prompt. (parameter=input_tokens, value=2049)", 2049),
    ("This model's maximum context length is 2048 tokens. However, your request has 4021 input tokens. "
     "Please reduce the length of the input messages.", 4021),
    ("Input length (2600) must be smaller than the model context length (2048).", 2600),  # LMDeploy
    ("The model `x` does not exist.", None),
])
def test_context_refusals_of_each_engine_say_the_prompts_length(message: str, tokens: int | None) -> None:
    """The prompt's length (at least) is read from vLLM's and LMDeploy's refusals, nothing from other 400s."""
    body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}})
    assert refused_prompt_tokens(400, body.encode()) == tokens
    assert refused_prompt_tokens(404, body.encode()) is None
