"""Where vLLM and LMDeploy differ as a client sees them, in one table.

The scheduler and the handlers are shared; everything engine-specific that leaks into an
HTTP response (error shapes and type names, metric names, stream chunk details, response
ids, runtime adapter loading, continuing a trailing assistant message) is read from here.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fleetgate.hashing import stable_hash
from workers.simulator.config import SimConfig
from workers.simulator.metrics import LmdeployMetrics, VllmMetrics, vllm_cache_config

# "validation": a body that fails vLLM's request schema (FastAPI/pydantic: type "Bad Request").
ErrorKind = Literal[
    "not_found", "bad_request", "invalid_input", "invalid_request", "internal", "validation"
]


class SimError(Exception):
    """An error the engine answers with; the flavour decides its JSON shape."""

    def __init__(
        self, status: int, kind: ErrorKind, message: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param


Metrics = VllmMetrics | LmdeployMetrics


@dataclass(frozen=True, kw_only=True)
class Flavor:
    name: str
    owned_by: str
    runtime_lora: bool
    responses_api: bool  # serves /v1/responses (vLLM); LMDeploy answers its 404
    tokenizer_api: bool  # serves /tokenize and /detokenize (vLLM)
    role_in_every_chunk: bool
    continue_trailing_assistant: bool
    # Several choices (`n` > 1) and several completion prompts per request (vLLM).
    multi_choice: bool
    # vLLM's system_fingerprint, and its null extension fields in chat and completion
    # bodies; None: LMDeploy's plainer bodies.
    fingerprint: str | None
    health_body: bytes
    error_types: Mapping[ErrorKind, str]
    error_body: Callable[[SimError, str], dict[str, Any]]
    too_long: Callable[[int, int], str]
    too_long_param: str | None
    completion_id: Callable[[], str]
    chat_id: Callable[[], str]
    make_metrics: Callable[[SimConfig], Metrics]

    def error_json(self, err: SimError) -> dict[str, Any]:
        return self.error_body(err, self.error_types[err.kind])


def _vllm_error(err: SimError, type_: str) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": type_, "param": err.param, "code": err.status}
    }


def _lmdeploy_error(err: SimError, type_: str) -> dict[str, Any]:
    return {
        "message": err.message,
        "type": type_,
        "code": err.status,
        "param": err.param,
        "object": "error",
    }


def _vllm_metrics(cfg: SimConfig) -> Metrics:
    cache_info = vllm_cache_config(
        num_gpu_blocks=cfg.resolved("num_gpu_blocks"),
        block_size=cfg.resolved("block_size"),
        max_model_len=cfg.max_model_len,
        num_gpu_blocks_override=cfg.num_gpu_blocks,
        user_specified_block_size=cfg.block_size is not None,
    )
    return VllmMetrics(cfg.served_model_name, cache_info, cfg.lora_slots)


def _uuid_id(prefix: str) -> Callable[[], str]:
    return lambda: f"{prefix}{uuid.uuid4().hex}"


def _flavors() -> dict[str, Callable[[SimConfig], Flavor]]:
    def vllm(cfg: SimConfig) -> Flavor:
        return Flavor(
            name="vllm",
            owned_by="vllm",
            runtime_lora=True,
            responses_api=True,
            tokenizer_api=True,
            role_in_every_chunk=False,
            continue_trailing_assistant=False,
            multi_choice=True,
            fingerprint=f"vllm-0.32.0-{stable_hash(cfg.served_model_name) & 0xFFFFFFFF:08x}",
            health_body=b"",
            error_types={
                "not_found": "NotFoundError",
                "bad_request": "BadRequestError",
                "invalid_input": "InvalidUserInput",
                "invalid_request": "invalid_request_error",
                "internal": "InternalServerError",
                "validation": "Bad Request",
            },
            error_body=_vllm_error,
            too_long=lambda n, limit: (
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {n} input tokens. Please reduce the length of the input messages."
            ),
            too_long_param="input_tokens",
            completion_id=_uuid_id("cmpl-"),
            chat_id=_uuid_id("chatcmpl-"),
            make_metrics=_vllm_metrics,
        )

    def lmdeploy(cfg: SimConfig) -> Flavor:
        session = itertools.count(1)
        return Flavor(
            name="lmdeploy",
            owned_by="lmdeploy",
            runtime_lora=False,
            responses_api=False,
            tokenizer_api=False,
            role_in_every_chunk=True,
            continue_trailing_assistant=True,
            multi_choice=False,
            fingerprint=None,
            health_body=b'{"status":"healthy"}',
            error_types={
                "not_found": "not_found_error",
                "bad_request": "invalid_request_error",
                "invalid_input": "invalid_request_error",
                "invalid_request": "invalid_request_error",
                "internal": "internal_error",
                "validation": "invalid_request_error",
            },
            error_body=_lmdeploy_error,
            too_long=lambda n, limit: (
                f"Input length ({n}) must be smaller than the model context length ({limit})."
            ),
            too_long_param=None,
            completion_id=lambda: "-1",
            chat_id=lambda: str(next(session)),
            # LMDeploy refreshes its load gauges every 10 s (hard-coded); scaled like all time.
            make_metrics=lambda c: LmdeployMetrics(c.served_model_name, 10.0 * c.time_scale),
        )

    return {"vllm": vllm, "lmdeploy": lmdeploy}


def make_flavor(cfg: SimConfig) -> Flavor:
    return _flavors()[cfg.flavor](cfg)
