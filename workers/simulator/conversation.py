"""The Responses API's memory on the simulator: stored responses, and the conversation a
request renders (vLLM's construct_input_messages), one validated request at a time (`Turn`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.simulator.requests import Prepared, bad
from workers.simulator.seqs import Seq
from workers.simulator.tokens import message_text

STORE_SIZE = 4096
Json = dict[str, Any]


@dataclass(kw_only=True)
class Stored:
    response: Json
    messages: list[Json]  # the conversation this response answered
    seq: Seq | None = None  # set while a background response runs


class ResponseStore:
    """The newest `size` responses by id; reading one keeps it."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, response_id: str, item: Stored) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One validated /v1/responses request."""

    id: str
    prep: Prepared
    messages: list[Json]
    echo: Json  # the request fields the response object repeats, in vLLM's order
    store: bool
    background: bool
    created_at: int = field(default_factory=lambda: int(time.time()))


def input_messages(value: Any) -> list[Json]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad("input must be a string or a list of input items", "input")
    messages = []
    for item in value:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise bad("the simulator supports message input items only", "input")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad("every input message needs a role", "input")
        try:
            text = message_text(item.get("content"))
        except ValueError as exc:
            raise bad(str(exc), "input") from exc
        messages.append({"role": role, "content": text})
    return messages


def conversation(body: Mapping[str, Any], previous: Stored | None) -> list[Json]:
    """vLLM's construct_input_messages."""
    messages: list[Json] = []
    instructions = body.get("instructions")
    if instructions:
        if not isinstance(instructions, str):
            raise bad("instructions must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    if previous is not None:
        messages += [m for m in previous.messages if m["role"] != "system"]
        for item in previous.response["output"]:
            if item.get("type") == "message":
                messages += [{"role": "assistant", "content": p["text"]} for p in item["content"]]
    return messages + input_messages(body.get("input"))
