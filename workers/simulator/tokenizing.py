"""vLLM's `/tokenize` and `/detokenize`, with the simulator's own tokenizer.

A prompt is encoded as the simulator counts it (tokens.py); `messages` are rendered as the
chat endpoints render them. Shapes, codes and messages are vLLM 0.32's, as captured in
tests/data/vllm_pooling/.
"""

from __future__ import annotations

from typing import Any

from workers.simulator.requests import Context, bad, invalid, resolve_model
from workers.simulator.tokens import render_prompt

Json = dict[str, Any]


def _flag(body: Json, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise bad(f"{key} must be a boolean", key)
    return value


def tokenize(body: Any, ctx: Context) -> Json:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    resolve_model(body, ctx)
    strs = bool(body.get("return_token_strs"))  # null counts as false, as in vLLM
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise bad("messages must be a list of messages with a role", "messages")
        add_prompt = _flag(body, "add_generation_prompt", True)
        continue_final = _flag(body, "continue_final_message", False)
        if add_prompt and continue_final:
            raise bad(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            )
        try:
            text = render_prompt(
                ctx.tokens, messages, add_generation_prompt=add_prompt, continue_final=continue_final,
            )  # fmt: skip
        except ValueError as exc:
            raise bad(str(exc), "messages") from exc
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        items = f"<dict of {len(body)} items>"
        raise invalid(("missing", "body.prompt", "Field required", items),
                      ("missing", "body.messages", "Field required", items))  # fmt: skip
    ids = ctx.tokens.encode(text)
    return {
        "count": len(ids),
        "max_model_len": ctx.max_model_len,
        "tokens": ids,
        "token_strs": ctx.tokens.token_strs(ids) if strs else None,
    }


def detokenize(body: Any, ctx: Context) -> Json:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    resolve_model(body, ctx)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise invalid(("missing", "body.tokens", "Field required", f"<dict of {len(body)} items>"))
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise invalid(
                ("int_type", f"body.tokens.{i}", "Input should be a valid integer", str(t))
            )
        if t < 0:
            raise invalid(
                ("greater_than_equal", f"body.tokens.{i}", "Input should be greater than or equal to 0", str(t)),
                ctx={"ge": 0},
            )  # fmt: skip
    # Like vLLM's tokenizer, ids outside the vocabulary decode to nothing.
    return {"prompt": ctx.tokens.decode([t for t in ids if ctx.tokens.known(t)])}
