"""Validating an OpenAI request body into what the scheduler needs, with vLLM's errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from workers.simulator.flavors import Flavor, SimError
from workers.simulator.tokens import Tokens, render_chat

Kind = Literal["chat", "completion", "response"]


@dataclass(frozen=True, kw_only=True)
class Prepared:
    kind: Kind
    model: str
    adapter: str | None
    prompt_text: str
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    seed: int


@dataclass(frozen=True, kw_only=True)
class Context:
    served_name: str
    adapters: Mapping[str, str]
    tokens: Tokens
    max_model_len: int
    kv_tokens: int
    flavor: Flavor


def bad(message: str, param: str | None = None) -> SimError:
    return SimError(400, "bad_request", message, param)


def invalid(*errors: tuple[str, str, str, str], ctx: dict[str, Any] | None = None) -> SimError:
    """A schema error as vLLM reports pydantic's: (type, loc, msg, input) per error, each
    written as the dict's repr."""
    lines = [f"{len(errors)} validation error{'s' if len(errors) > 1 else ''}:"]
    for kind, loc, msg, value in errors:
        error: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
        if ctx:
            error["ctx"] = ctx
        lines.append(f"  {error}")
    return SimError(400, "validation", "\n".join(lines), errors[0][1])


def opt_int(body: Mapping[str, Any], key: str, minimum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{key} must be an integer", key)
    if minimum is not None and value < minimum:
        raise bad(f"{key} must be at least {minimum}, got {value}.", key)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise bad("stop must be a string or a list of strings", "stop")


def _chat_prompt(body: Mapping[str, Any], flavor: Flavor) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad("every message needs a string role", "messages")
    trailing_assistant = messages[-1]["role"] == "assistant"
    if flavor.continue_trailing_assistant:
        continue_final, add_prompt = trailing_assistant, not trailing_assistant
    else:
        continue_final = bool(body.get("continue_final_message", False))
        add_prompt = bool(body.get("add_generation_prompt", True))
        if continue_final and add_prompt:
            raise bad(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        if continue_final and not trailing_assistant:
            raise bad("continue_final_message needs a final assistant message", "messages")
    try:
        return render_chat(
            messages, add_generation_prompt=add_prompt, continue_final=continue_final
        )
    except ValueError as exc:
        raise bad(str(exc), "messages") from exc


def _completion_prompt(body: Mapping[str, Any], tokens: Tokens) -> tuple[str, list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt, tokens.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), list(prompt)
    raise bad("prompt must be a non-empty string or token list (one prompt only)", "prompt")


def resolve_model(body: Mapping[str, Any], ctx: Context) -> tuple[str, str | None]:
    """The requested model and its adapter (None for the base), or vLLM's 404."""
    model = body.get("model") or ctx.served_name
    if not isinstance(model, str):
        raise bad("model must be a string", "model")
    if model != ctx.served_name and model not in ctx.adapters:
        raise SimError(404, "not_found", f"The model `{model}` does not exist.", "model")
    return model, None if model == ctx.served_name else model


def prepare(body: Any, kind: Kind, ctx: Context) -> Prepared:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model, adapter = resolve_model(body, ctx)
    if body.get("n") not in (None, 1):
        raise bad("the simulator supports n=1 only", "n")
    if kind == "chat":
        prompt_text = _chat_prompt(body, ctx.flavor)
        prompt_ids = ctx.tokens.encode(prompt_text)
    else:
        prompt_text, prompt_ids = _completion_prompt(body, ctx.tokens)
    n_prompt = len(prompt_ids)
    if n_prompt >= ctx.max_model_len:
        raise bad(ctx.flavor.too_long(n_prompt, ctx.max_model_len), ctx.flavor.too_long_param)
    if n_prompt + 1 > ctx.kv_tokens:
        raise bad(f"the prompt ({n_prompt} tokens) does not fit the KV cache ({ctx.kv_tokens})")
    wanted = opt_int(body, "max_completion_tokens", 1)
    if wanted is None:
        wanted = opt_int(body, "max_tokens", 1)
    room = min(ctx.max_model_len, ctx.kv_tokens) - n_prompt
    max_tokens = room if wanted is None else min(wanted, room)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad("stream_options must be an object", "stream_options")
    return Prepared(
        kind=kind,
        model=model,
        adapter=adapter,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        max_tokens=max(1, max_tokens),
        ignore_eos=bool(body.get("ignore_eos", False)),
        stop=_stop(body.get("stop")),
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        seed=opt_int(body, "seed") or 0,
    )
