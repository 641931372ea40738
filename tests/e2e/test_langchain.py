"""LangChain's `ChatOpenAI` against a real gateway and simulated workers: invoke, stream,
and a forced tool call (bound tools), whole and streamed, as LangChain users write them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import yaml
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import SecretStr

from tests.conftest import Fleet

MODEL = "lc-model"


@tool
def get_weather(city: str, days: int, unit: str = "c") -> str:
    """The weather forecast for a city, `days` days ahead."""
    return f"sunny in {city}"


@pytest.fixture
def gateway_url(fleet_factory: Callable[[], Fleet], tmp_path: Path) -> Iterator[str]:
    fleet = fleet_factory()
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"gateway": {"aliases": {"assistant": [{"model": MODEL}]}}}))
    _, url = fleet.gateway("--config", str(config))
    fleet.worker("lc", "--model", MODEL, "--option", "time_scale=0.05")
    fleet.wait_ready(url, "lc")
    yield url


def _llm(url: str, model: str = MODEL, **extra: object) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=f"{url}/v1", api_key=SecretStr("unused"), max_retries=0,
                      timeout=60, max_tokens=24, **extra)  # type: ignore[call-arg, arg-type]


def _chunks(stream: Iterable[BaseMessage]) -> list[AIMessageChunk]:
    out = list(stream)
    assert all(isinstance(c, AIMessageChunk) for c in out)
    return out  # type: ignore[return-value]


def _join(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    return whole


def test_invoke_and_stream(gateway_url: str) -> None:
    """invoke gets one AIMessage with the engine's usage; stream gets text in several chunks
    that add up to one message, with usage at the end."""
    llm = _llm(gateway_url)
    reply = llm.invoke([SystemMessage("You are terse."), HumanMessage("Say hello.")])
    assert isinstance(reply, AIMessage) and reply.content
    assert reply.response_metadata["model_name"] == MODEL
    assert reply.usage_metadata and reply.usage_metadata["input_tokens"] > 0
    chunks = _chunks(_llm(gateway_url, stream_usage=True).stream("Count to five."))
    assert len(chunks) > 2
    whole = _join(chunks)
    assert whole.content and whole.usage_metadata and whole.usage_metadata["output_tokens"] > 0


async def test_ainvoke_through_an_alias(gateway_url: str) -> None:
    """The async client works too, and an alias answers with the real model's name."""
    reply = await _llm(gateway_url, model="assistant").ainvoke("hi")
    assert reply.content and reply.response_metadata["model_name"] == MODEL


def test_forced_tool_call(gateway_url: str) -> None:
    """bind_tools with tool_choice naming the tool: a tool call whose arguments parse and
    match the schema (city a string, days an integer)."""
    llm = _llm(gateway_url).bind_tools([get_weather], tool_choice="get_weather")
    reply = llm.invoke("What is the weather in Paris in two days?")
    assert isinstance(reply, AIMessage) and not reply.invalid_tool_calls
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    assert isinstance(call["args"]["city"], str) and isinstance(call["args"]["days"], int)
    assert get_weather.invoke(call["args"]).startswith("sunny in")


def test_streamed_tool_call_and_required_choice(gateway_url: str) -> None:
    """Streamed, the call arrives in pieces (name first, then argument fragments) that
    LangChain joins into the same call; tool_choice="any" (OpenAI's "required") works too."""
    llm = _llm(gateway_url).bind_tools([get_weather], tool_choice="any")
    chunks = _chunks(llm.stream("Weather in Oslo?"))
    assert sum(bool(c.tool_call_chunks) for c in chunks) > 2  # streamed piece by piece
    whole = _join(chunks)
    [call] = whole.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) >= {"city", "days"}
    assert whole.response_metadata.get("finish_reason") == "tool_calls"
