"""vLLM's Responses API (`/v1/responses`) on the simulator's scheduler.

vLLM renders a response request as a chat: the request's instructions as a system message,
then, with `previous_response_id`, the stored conversation (its system messages dropped)
and the previous output as assistant messages, then the new input. A follow-up on the same
engine therefore starts with the previous prompt and hits the prefix cache.

vLLM keeps responses only when started with VLLM_ENABLE_RESPONSES_API_STORE=1 (the
simulator's `--enable-responses-store`, which defaults to that variable). Otherwise `store`
is silently ignored and every GET, cancel or `previous_response_id` is a 404. vLLM's store
grows for ever; ours keeps the newest few thousand.

Shapes, codes and messages are vLLM 0.32's, as captured in tests/data/vllm_responses/.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web

from workers.simulator.config import Faults
from workers.simulator.conversation import Json, ResponseStore, Stored, Turn, conversation
from workers.simulator.flavors import SimError
from workers.simulator.requests import Context, Prepared, bad, opt_int, resolve_model
from workers.simulator.seqs import Seq
from workers.simulator.streams import EventStream
from workers.simulator.tokens import render_prompt

Abort = Callable[[Seq], None]


def _short_uuid() -> str:
    return uuid.uuid4().hex[:16]  # vLLM's random_uuid()


def not_found(response_id: str) -> SimError:
    message = f"Response with id '{response_id}' not found."
    return SimError(404, "invalid_request", message, "response_id")


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(f"{key} must be a number", key)
    return float(value)


def _too_long(limit: int) -> SimError:
    # vLLM tokenizes at most max_model_len + 1 tokens, so it never knows the real count.
    n = limit + 1
    return bad(
        f"This model's maximum context length is {limit} tokens. However, your prompt "
        f"contains at least {n} input tokens, which exceeds this limit even without any "
        "output tokens. Please reduce the length of the input prompt. "
        f"(parameter=input_tokens, value={n})",
        "input_tokens",
    )


def _output_budget(body: dict[str, Any], n: int, ctx: Context) -> int:
    """The most a response may generate after a prompt of `n` tokens (vLLM's checks first)."""
    limit = ctx.max_model_len
    if n > limit:
        raise _too_long(limit)
    if n == limit:
        message = (
            f"The engine prompt length {n} exceeds the max_model_len {limit}. "
            "Please reduce prompt."
        )
        raise SimError(400, "invalid_request", message, "input")
    if n + 1 > ctx.kv_tokens:
        raise bad(f"the prompt ({n} tokens) does not fit the KV cache ({ctx.kv_tokens})")
    wanted = opt_int(body, "max_output_tokens", 1)
    if wanted is not None and wanted > limit:
        raise bad(
            f"max_output_tokens={wanted} cannot be greater than max_model_len={limit}. "
            f"Please request fewer output tokens. (parameter=max_output_tokens, value={wanted})",
            "max_output_tokens",
        )
    room = min(limit, ctx.kv_tokens) - n
    return max(1, room if wanted is None else min(wanted, room))


class Responses:
    """One engine's Responses API: request parsing, response objects, the store."""

    def __init__(self, *, store_enabled: bool, block_size: int) -> None:
        self.store_enabled = store_enabled
        self.block_size = block_size
        self.store = ResponseStore()
        self._tasks: set[asyncio.Task[None]] = set()

    # --- requests ------------------------------------------------------------------------
    def parse(self, body: Any, ctx: Context) -> Turn:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        model, adapter = resolve_model(body, ctx)
        if "input" not in body:
            raise bad("Field required", "body.input")
        store, background = self._store_and_background(body)
        previous = None
        previous_id = body.get("previous_response_id")
        if previous_id is not None:
            previous = self.store.get(str(previous_id))
            if previous is None:
                raise not_found(str(previous_id))
        messages = conversation(body, previous)
        prompt_text = render_prompt(
            ctx.tokens, messages, add_generation_prompt=True, continue_final=False,
        )  # fmt: skip
        prompt_ids = ctx.tokens.encode(prompt_text)
        max_tokens = _output_budget(body, len(prompt_ids), ctx)
        request_id = body.get("request_id")
        tools = body.get("tools") or []
        tool_choice = body.get("tool_choice", "auto")
        if not tools and tool_choice in ("auto", "none"):
            tool_choice = "none"
        echo = {
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata"),
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "temperature": _number(body, "temperature", 1.0),
            "tool_choice": tool_choice,
            "tools": tools,
            "top_p": _number(body, "top_p", 1.0),
            "background": background,
            "max_output_tokens": max_tokens,
            "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": previous_id,
            "prompt": body.get("prompt"),
            "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier") or "auto",
            "text": body.get("text"),
            "top_logprobs": None,
            "truncation": body.get("truncation") or "disabled",
            "user": body.get("user"),
            "presence_penalty": _number(body, "presence_penalty", 0.0),
            "frequency_penalty": _number(body, "frequency_penalty", 0.0),
        }
        prep = Prepared(
            kind="response",
            model=model,
            adapter=adapter,
            prompt_text=prompt_text,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            ignore_eos=bool(body.get("ignore_eos", False)),
            stop=(),
            stream=bool(body.get("stream", False)),
            include_usage=False,
            seed=opt_int(body, "seed") or 0,
        )
        return Turn(
            id=request_id if isinstance(request_id, str) and request_id else f"resp_{_short_uuid()}",
            prep=prep, messages=messages, echo=echo, store=store, background=background,
        )  # fmt: skip

    def _store_and_background(self, body: dict[str, Any]) -> tuple[bool, bool]:
        """`store` (ignored, as vLLM does, when this engine cannot store) and `background`."""
        background = bool(body.get("background"))
        store = bool(body.get("store", True))
        if store and background and not self.store_enabled:
            raise SimError(
                400, "invalid_request",
                "This vLLM engine does not support `store=True` and therefore does not support "
                "the background mode. To enable these features, set the environment variable "
                "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
                "background",
            )  # fmt: skip
        if background and body.get("stream"):
            raise bad("the simulator does not stream background responses", "background")
        return store and self.store_enabled, background

    # --- response objects ----------------------------------------------------------------
    def response(self, turn: Turn, status: str, output: list[Json], seq: Seq | None = None) -> Json:
        body: Json = {
            "id": turn.id,
            "created_at": turn.created_at,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": None,
            "metadata": None,
            "model": turn.prep.model,
            "object": "response",
            "output": output,
        }
        body.update(turn.echo)
        body.update(
            status=status,
            usage=None if seq is None else self.usage(seq),
            kv_transfer_params=None,
            ec_transfer_params=None,
            input_messages=None,
            output_messages=None,
        )
        # vLLM's field order: status after service_tier, usage after truncation.
        order = (
            "id", "created_at", "incomplete_details", "instructions", "metadata", "model",
            "object", "output", "parallel_tool_calls", "temperature", "tool_choice", "tools",
            "top_p", "background", "max_output_tokens", "max_tool_calls",
            "previous_response_id", "prompt", "reasoning", "service_tier", "status", "text",
            "top_logprobs", "truncation", "usage", "user", "presence_penalty",
            "frequency_penalty", "kv_transfer_params", "ec_transfer_params", "input_messages",
            "output_messages",
        )  # fmt: skip
        return {key: body[key] for key in order}

    def usage(self, seq: Seq) -> Json:
        n, cached = seq.num_prompt, seq.cached_tokens
        written = max(0, n // self.block_size * self.block_size - cached)
        return {
            "input_tokens": n,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": written,
                "input_tokens_per_turn": [],
                "cached_tokens_per_turn": [],
            },
            "output_tokens": seq.generated,
            "output_tokens_details": {
                "reasoning_tokens": 0,
                "tool_output_tokens": 0,
                "output_tokens_per_turn": [],
                "tool_output_tokens_per_turn": [],
            },
            "total_tokens": n + seq.generated,
        }

    def _finish(self, turn: Turn, seq: Seq, finish: str, output: list[Json]) -> Json:
        status = "incomplete" if finish == "length" else "completed"
        final = self.response(turn, status, output, seq)
        if turn.store:
            held = self.store.get(turn.id)
            if held is None or held.response["status"] != "cancelled":
                self.store.put(turn.id, Stored(response=final, messages=turn.messages))
        return final

    # --- the three ways to answer --------------------------------------------------------
    async def complete(self, turn: Turn, seq: Seq) -> Json:
        parts = []
        while True:
            event = await seq.events.get()
            parts.append(event.text)
            if event.finish:
                break
        text = "".join(parts)
        return self._finish(turn, seq, event.finish, [_message(f"msg_{_short_uuid()}", text)])

    def start_background(self, turn: Turn, seq: Seq) -> Json:
        """Answer "queued" now; the response is stored when it finishes (or is cancelled)."""
        queued = self.response(turn, "queued", [])
        self.store.put(turn.id, Stored(response=queued, messages=turn.messages, seq=seq))
        task = asyncio.create_task(self._run_background(turn, seq), name=f"bg-{turn.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return queued

    async def _run_background(self, turn: Turn, seq: Seq) -> None:
        await self.complete(turn, seq)

    def cancel(self, response_id: str, abort: Abort) -> Json:
        held = self.store.get(response_id)
        if held is None:
            raise not_found(response_id)
        if held.response["status"] not in ("queued", "in_progress"):
            raise SimError(
                400, "invalid_request", "Cannot cancel a synchronous response.", "response_id"
            )
        held.response["status"] = "cancelled"
        if held.seq is not None:
            abort(held.seq)
        for task in self._tasks:
            if task.get_name() == f"bg-{response_id}":
                task.cancel()
        return held.response

    def retrieve(self, response_id: str) -> Json:
        held = self.store.get(response_id)
        if held is None:
            raise not_found(response_id)
        return held.response

    async def stream(
        self, request: web.Request, turn: Turn, seq: Seq, faults: Faults, abort: Abort
    ) -> web.StreamResponse:
        out = await EventStream.open(
            request, faults, lambda: abort(seq), "text/event-stream; charset=utf-8"
        )
        number = 0

        async def send(kind: str, data: Json) -> None:
            nonlocal number
            # vLLM's events are OpenAI's pydantic models: their fields are in name order.
            data = dict(sorted({**data, "sequence_number": number, "type": kind}.items()))
            number += 1
            await out.write(
                b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"
            )

        started = self.response(turn, "in_progress", [])
        await send("response.created", {"response": started})
        await send("response.in_progress", {"response": started})
        item_id, text = "", ""
        while True:
            event = await seq.events.get()
            if event.text and not item_id:  # vLLM opens the message at the first text
                item_id = f"msg_{_short_uuid()}"
                added: Json = {"id": item_id, "content": [], "role": "assistant",
                         "status": "in_progress", "type": "message", "phase": None}  # fmt: skip
                await send("response.output_item.added", {"item": added, "output_index": 0})
                part = {"annotations": [], "text": "", "type": "output_text", "logprobs": []}
                await send(
                    "response.content_part.added",
                    {"content_index": 0, "item_id": item_id, "output_index": 0, "part": part},
                )
            if event.text:
                text += event.text
                await send(
                    "response.output_text.delta",
                    {"content_index": 0, "delta": event.text, "item_id": item_id,
                     "logprobs": [], "output_index": 0},
                )  # fmt: skip
            if event.finish:
                break
        output = []
        if item_id:
            item = _message(item_id, text)
            await send(
                "response.output_text.done",
                {"content_index": 0, "item_id": item_id, "logprobs": [], "output_index": 0,
                 "text": text},
            )  # fmt: skip
            await send(
                "response.content_part.done",
                {
                    "content_index": 0,
                    "item_id": item_id,
                    "output_index": 0,
                    "part": item["content"][0],
                },
            )
            await send("response.output_item.done", {"item": item, "output_index": 0})
            output.append(item)
        final = self._finish(turn, seq, event.finish, output)
        await send("response.completed", {"response": final})
        return await out.close()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def _message(item_id: str, text: str) -> Json:
    part: Json = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    return {
        "id": item_id,
        "content": [part] if text else [],
        "role": "assistant",
        "status": "completed",
        "type": "message",
        "phase": None,
    }
