"""Validating an OpenAI request body into what the scheduler needs, with vLLM's errors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from workers.simulator.flavors import Flavor, SimError
from workers.simulator.tokens import Tokens, render_prompt
from workers.simulator.tools import ToolCall, forced_call

Kind = Literal["chat", "completion", "response"]
MAX_N = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]
    max_tokens: int


@dataclass(frozen=True, kw_only=True)
class Prepared:
    kind: Kind
    model: str
    adapter: str | None
    prompt_text: str  # the first (or only) prompt
    prompt_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    seed: int
    n: int = 1  # choices per prompt
    more_prompts: tuple[Prompt, ...] = ()  # a completion's second and later prompts
    tool_call: ToolCall | None = None  # a chat's forced tool call (workers/simulator/tools.py)

    @property
    def prompts(self) -> tuple[Prompt, ...]:
        """Every prompt; the choice `index` of prompt p's choice c is p * n + c."""
        return (Prompt(self.prompt_text, self.prompt_ids, self.max_tokens), *self.more_prompts)


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
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # vLLM's pydantic (lax mode) takes a whole float as the integer
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


def _chat_prompt(body: Mapping[str, Any], ctx: Context) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise bad("every message needs a string role", "messages")
    trailing_assistant = messages[-1]["role"] == "assistant"
    if ctx.flavor.continue_trailing_assistant:
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
        return render_prompt(
            ctx.tokens, messages, add_generation_prompt=add_prompt, continue_final=continue_final,
        )  # fmt: skip
    except ValueError as exc:
        raise bad(str(exc), "messages") from exc


def _completion_prompt(body: Mapping[str, Any], ctx: Context) -> tuple[str, list[int]]:
    """The only prompt of a request of an engine that takes one (LMDeploy)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt, ctx.tokens.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), list(prompt)
    raise bad("prompt must be a non-empty string or token list (one prompt only)", "prompt")


def _int_errors(value: Any, loc: str) -> tuple[str, str, str, str] | None:
    """Pydantic's (lax) complaint about `value` as an int, or None when it is one."""
    if isinstance(value, bool | int):
        return None
    if isinstance(value, float):
        if value.is_integer():
            return None
        msg = "Input should be a valid integer, got a number with a fractional part"
        return ("int_from_float", loc, msg, repr(value))
    if isinstance(value, str):
        try:
            int(value.strip())
        except ValueError:
            msg = "Input should be a valid integer, unable to parse string as an integer"
            return ("int_parsing", loc, msg, value)
        return None
    return ("int_type", loc, "Input should be a valid integer", _shown(value))


def _shown(value: Any) -> str:
    """How vLLM's schema errors print an input."""
    return f"<list of {len(value)} items>" if isinstance(value, list) else str(value)


def parse_n(body: Mapping[str, Any], kind: Kind) -> int:
    """`n` as vLLM's request schema takes it: chat allows null (1), completions do not."""
    value = body.get("n", 1)
    if value is None and kind == "chat":
        return 1
    error = _int_errors(value, "body.n")
    if error:
        raise invalid(error)
    return int(value.strip() if isinstance(value, str) else value)


def check_n(n: int, temperature: Any) -> None:
    """vLLM's SamplingParams checks, after the model and the prompt."""
    if n < 1:
        raise bad(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise bad(
            f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
            "VLLM_MAX_N_SEQUENCES environment variable."
        )
    greedy = isinstance(temperature, int | float) and temperature < 1e-5
    if greedy and n > 1:
        raise bad(f"n must be 1 when using greedy sampling, got {n}.")


def parse_prompts(prompt: Any) -> list[str | list[int]] | None:
    """A completion's prompts as vLLM's schema takes them: a string, a token list, or a
    list of either (not mixed). None when absent or an empty string."""
    if isinstance(prompt, str) or prompt is None:
        return [prompt] if prompt else None
    if not isinstance(prompt, list):
        raise invalid(("string_type", "body.prompt", "Input should be a valid string",
                       _shown(prompt)))  # fmt: skip
    if all(isinstance(x, int) and not isinstance(x, bool) for x in prompt) and prompt:
        return [prompt]
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    if all(isinstance(x, list) and all(type(t) is int for t in x) for x in prompt):
        return list(prompt)
    raise invalid(*_union_errors(prompt))


def _union_errors(prompt: list[Any]) -> list[tuple[str, str, str, str]]:
    """Pydantic's errors for a list that fits none of list[int] | list[list[int]] | str |
    list[str], member by member as vLLM reports them."""
    as_ints = [_int_errors(x, f"body.prompt.{i}") for i, x in enumerate(prompt)]
    errors = [e for e in as_ints if e]
    for i, x in enumerate(prompt):
        if not isinstance(x, list):
            errors.append(("list_type", f"body.prompt.{i}", "Input should be a valid list",
                           _shown(x)))  # fmt: skip
        else:
            inner = (_int_errors(t, f"body.prompt.{i}.{j}") for j, t in enumerate(x))
            errors += [e for e in inner if e]
    errors.append(("string_type", "body.prompt", "Input should be a valid string",
                   _shown(prompt)))  # fmt: skip
    errors += [
        ("string_type", f"body.prompt.{i}", "Input should be a valid string", _shown(x))
        for i, x in enumerate(prompt)
        if not isinstance(x, str)
    ]
    return errors


def encode_prompts(
    prompts: list[str | list[int]] | None, tokens: Tokens
) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt, or vLLM's 400 for a missing or empty one."""
    if prompts is None:
        raise bad(
            "Either prompt or prompt_embeds must be provided and non-empty. (parameter=prompt)",
            "prompt",
        )
    if not prompts:
        raise bad("You must pass at least one prompt")
    if not all(prompts):
        raise bad("The decoder prompt cannot be empty")
    return [
        (p, tokens.encode(p)) if isinstance(p, str) else (" ".join(map(str, p)), list(p))
        for p in prompts
    ]


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
    multi = ctx.flavor.multi_choice  # else LMDeploy: one prompt, one choice
    n = parse_n(body, kind) if multi else 1
    prompts = parse_prompts(body.get("prompt")) if multi and kind == "completion" else None
    model, adapter = resolve_model(body, ctx)
    if not multi and body.get("n") not in (None, 1):
        raise bad("the simulator supports n=1 only", "n")
    if kind == "chat":
        text = _chat_prompt(body, ctx)
        texts_ids = [(text, ctx.tokens.encode(text))]
    elif multi:
        texts_ids = encode_prompts(prompts, ctx.tokens)
    else:
        texts_ids = [_completion_prompt(body, ctx)]
    if multi:
        check_n(n, body.get("temperature"))
    wanted = opt_int(body, "max_completion_tokens", 1)
    if wanted is None:
        wanted = opt_int(body, "max_tokens", 1)
    if kind == "completion" and "max_tokens" not in body:
        wanted = COMPLETION_DEFAULT_MAX_TOKENS  # OpenAI's and vLLM's default (an explicit null: the rest)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad("stream_options must be an object", "stream_options")
    first, *more = [Prompt(t, ids, _max_tokens(ids, wanted, ctx)) for t, ids in texts_ids]
    return Prepared(
        kind=kind,
        model=model,
        adapter=adapter,
        prompt_text=first.text,
        prompt_ids=first.ids,
        max_tokens=first.max_tokens,
        ignore_eos=bool(body.get("ignore_eos", False)),
        stop=_stop(body.get("stop")),
        stream=bool(body.get("stream", False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        seed=opt_int(body, "seed") or 0,
        n=n,
        more_prompts=tuple(more),
        tool_call=forced_call(body, opt_int(body, "seed") or len(first.ids)) if kind == "chat" else None,
    )


# /v1/completions without `max_tokens` generates 16 tokens (vLLM's CompletionRequest default).
COMPLETION_DEFAULT_MAX_TOKENS = 16


def _max_tokens(ids: list[int], wanted: int | None, ctx: Context) -> int:
    """max_tokens cut to what the context and the KV cache leave, or vLLM's 400 for a prompt
    that does not fit at all."""
    n_prompt = len(ids)
    if n_prompt >= ctx.max_model_len:
        raise bad(ctx.flavor.too_long(n_prompt, ctx.max_model_len), ctx.flavor.too_long_param)
    if n_prompt + 1 > ctx.kv_tokens:
        raise bad(f"the prompt ({n_prompt} tokens) does not fit the KV cache ({ctx.kv_tokens})")
    room = min(ctx.max_model_len, ctx.kv_tokens) - n_prompt
    return max(1, room if wanted is None else min(wanted, room))
