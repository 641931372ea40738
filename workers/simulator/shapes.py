"""Chat and completion bodies, whole or as stream chunks, keyed as the engine writes them.

vLLM 0.32 (tests/data/vllm_choices/) adds null extension fields to every choice and body and
a `system_fingerprint`; LMDeploy's bodies (Flavor.fingerprint None) have none of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from workers.simulator.flavors import Flavor
from workers.simulator.requests import Prepared
from workers.simulator.seqs import Seq
from workers.simulator.tools import delta, message_calls

# Top-level fields vLLM appends after `usage` in a whole body.
_CHAT_TAIL = ("prompt_logprobs", "prompt_token_ids", "prompt_text",
              "kv_transfer_params", "ec_transfer_params", "metrics")  # fmt: skip
_COMPLETION_TAIL = ("kv_transfer_params", "ec_transfer_params", "metrics")
_MESSAGE_NULLS = ("refusal", "annotations", "audio", "function_call", "reasoning")


def usage(seqs: Sequence[Seq], n: int = 1, *, whole: bool = False) -> dict[str, Any]:
    """One request's usage as vLLM sums it: each prompt once (its first choice), every
    choice's output. cached_tokens is reported as with --enable-prompt-tokens-details."""
    firsts = seqs[::n]
    prompt = sum(s.num_prompt for s in firsts)
    completion = sum(s.generated for s in seqs)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
    }
    if whole:
        out["completion_tokens_details"] = None
    return out


class Shape:
    """The id, object names and choice layout of one chat or completion response."""

    def __init__(self, flavor: Flavor, prep: Prepared) -> None:
        self.flavor, self.prep = flavor, prep
        self.chat = prep.kind == "chat"
        self.vllm = flavor.fingerprint is not None
        self.id = flavor.chat_id() if self.chat else flavor.completion_id()
        self.created = int(time.time())
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.prep.model,
            "choices": choices,
        }

    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of one choice: the role, no text."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        body = self.envelope(self.chunk_object, [choice])
        if self.vllm:
            body.update(prompt_token_ids=None, prompt_text=None)
        return body

    def chunk(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if self.flavor.role_in_every_chunk:
                delta = {"role": "assistant", "content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            if self.vllm:
                if finish:
                    choice["stop_reason"] = None
                choice["token_ids"] = None
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": None}  # fmt: skip
            if self.vllm:
                choice.update(prompt_token_ids=None, token_ids=None)
        body = self.envelope(self.chunk_object, [choice])
        # vLLM stamps its fingerprint on each finishing chunk unless a usage chunk follows.
        if self.vllm and finish and not self.prep.include_usage:
            body["system_fingerprint"] = self.flavor.fingerprint
        return body

    def tool_chunk(self, index: int, piece: str, first: bool, finish: str | None) -> dict[str, Any]:
        """A chat stream chunk with a piece of the forced tool call's arguments."""
        call = self.prep.tool_call
        assert call is not None
        body = self.chunk(index, "", call.finish(finish))
        body["choices"][0]["delta"] = delta(call, piece, first)
        return body

    def usage_chunk(self, seqs: Sequence[Seq]) -> dict[str, Any]:
        body = self.envelope(self.chunk_object, [])
        body["usage"] = usage(seqs, self.prep.n)
        if self.vllm:
            body["system_fingerprint"] = self.flavor.fingerprint
        return body

    def whole(
        self, outputs: Sequence[tuple[str, str | None]], seqs: Sequence[Seq]
    ) -> dict[str, Any]:
        """The non-streamed body: (text, finish_reason) per choice, in index order."""
        choices = [self._choice(i, text, finish) for i, (text, finish) in enumerate(outputs)]
        body = self.envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.vllm:
            body.update(service_tier=None, system_fingerprint=self.flavor.fingerprint)
        body["usage"] = usage(seqs, self.prep.n, whole=self.vllm)
        if self.vllm:
            body.update(dict.fromkeys(_CHAT_TAIL if self.chat else _COMPLETION_TAIL))
        return body

    def _choice(self, index: int, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.vllm:
                message.update(dict.fromkeys(_MESSAGE_NULLS))
            else:
                message["tool_calls"] = []
            if (call := self.prep.tool_call) is not None:  # `text` is the arguments
                message.update(content="", tool_calls=message_calls(call, text))
                finish = call.finish(finish)
            choice = {"index": index, "message": message, "logprobs": None,
                      "finish_reason": finish, "stop_reason": None}  # fmt: skip
            if self.vllm:
                choice.update(token_ids=None, routed_experts=None)
            return choice
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}  # fmt: skip
        if self.vllm:
            choice.update(token_ids=None, prompt_logprobs=None, prompt_token_ids=None,
                          routed_experts=None)  # fmt: skip
        else:
            choice["prompt_logprobs"] = None
        return choice
