"""ms-swift's OpenAI server (`swift deploy`), run as one process.

Swift has no `/metrics` and no queue signal: the gateway's own in-flight count is the
load. Adapters are fixed at start (`--adapters name=path`). `/health`, `/ping` and
`/v1/models` answer without the API key (`--api_key`); completions need it.

Two of swift's habits are handled here rather than left to the agent:
- Asked for a busy port, swift silently binds the next free one, where nobody looks
  for it. The launcher below makes it bind exactly the port it was given, so a busy
  port is a start-up failure the agent sees (the engine exits).
- The `swift deploy` console script spawns a child that outlives it; running the
  deploy module directly keeps it one process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, ClassVar

from fleetgate.schema import Load
from workers.engines.base import (
    EngineSpec,
    EngineWork,
    FixedAtStart,
    engine_environment,
    engine_python,
    start_adapter_args,
)

# `python -c LAUNCH <swift deploy flags>`: swift 4.6's DeployArguments calls
# find_free_port(port), which moves to the next free port; make it keep the one asked for.
LAUNCH = (
    "import swift.arguments.deploy_args as a; a.find_free_port = lambda port=None, retry=0: port; "
    "from swift.pipelines import deploy_main; deploy_main()"
)

# Flags taken from the profile / command line, in the order they are emitted. Swift's
# flags keep their underscores; booleans take an explicit true/false.
_FLAGS = (
    "max_batch_size",
    "torch_dtype",
    "api_key",
    "verbose",
    "log_interval",
    "log_level",
    # --infer_backend vllm
    "vllm_tensor_parallel_size",
    "vllm_gpu_memory_utilization",
    "vllm_max_num_seqs",
    "vllm_max_model_len",
    "vllm_enforce_eager",
    "vllm_enable_prefix_caching",
    "vllm_max_lora_rank",
    # --infer_backend lmdeploy
    "lmdeploy_tp",
    "lmdeploy_session_len",
    "lmdeploy_cache_max_entry_count",
    "lmdeploy_quant_policy",
)

# Per-request logs and the 20-second throughput line are noise under an agent.
_QUIET = {"verbose": False, "log_interval": -1}


def swift_flags(options: Mapping[str, Any], known: tuple[str, ...]) -> list[str]:
    """`--flag value` pairs in swift's spelling; None is left out, booleans are spelled out."""
    argv: list[str] = []
    for key in known:
        value = options.get(key)
        if value is None:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        argv.extend([f"--{key}", text])
    return argv


class SwiftEngine(FixedAtStart):
    name: ClassVar[str] = "swift"
    label: ClassVar[str] = "swift"
    reports_load: ClassVar[bool] = False
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str | None] = None
    # The `--option` names it reads (anything else is a typo: the agent refuses it).
    options: ClassVar[frozenset[str]] = frozenset(_FLAGS) | {"python", "env", "enable_lora", "infer_backend", "model_type", "template"}

    def command(self, spec: EngineSpec) -> list[str]:
        python = engine_python(spec, "FLEETGATE_SWIFT_PYTHON")
        backend = str(spec.options.get("infer_backend") or "transformers")
        if backend not in ("transformers", "vllm", "lmdeploy"):
            raise ValueError(f"swift infer_backend must be transformers, vllm or lmdeploy, not {backend!r}")
        if spec.adapters and backend == "transformers" and self.capacity(spec) > 1:
            # Swift's transformers backend fails batched requests that use an adapter.
            raise ValueError("swift's transformers backend serves adapters only with max_batch_size 1")
        options: dict[str, Any] = {**_QUIET, **spec.options}
        tp = len(spec.gpu_ids) if len(spec.gpu_ids) > 1 else None
        if backend == "vllm":
            options.setdefault("vllm_max_model_len", spec.max_model_len)
            options.setdefault("vllm_tensor_parallel_size", tp)
        elif backend == "lmdeploy":
            options.setdefault("lmdeploy_session_len", spec.max_model_len)
            options.setdefault("lmdeploy_tp", tp)
        return [
            str(python), "-c", LAUNCH,
            "--model", os.path.abspath(spec.model) if os.path.exists(spec.model) else spec.model,
            "--model_type", str(spec.options.get("model_type") or "qwen2"),
            "--template", str(spec.options.get("template") or "qwen"),
            "--infer_backend", backend,
            "--host", spec.host,
            "--port", str(spec.port),
            "--served_model_name", spec.served_name,
            # The prompt limit: longer prompts are a 400. (Swift's --max_model_len is
            # something else: a target length for RoPE scaling.)
            "--max_length", str(spec.max_model_len),
            *swift_flags(options, _FLAGS),
            *start_adapter_args(spec),
            *spec.extra_args,
        ]  # fmt: skip

    def environment(self, spec: EngineSpec) -> dict[str, str]:
        # A local folder never reaches a hub; this keeps a mistyped one from trying.
        return engine_environment(spec, HF_HUB_OFFLINE="1")

    def capacity(self, spec: EngineSpec) -> int:
        # Serial (one request at a time) unless max_batch_size says otherwise.
        return int(spec.options.get("max_batch_size") or 1)

    def continues_trailing_assistant(self, spec: EngineSpec) -> bool:
        # Swift applies its own template whatever the backend, and continues the message.
        return True

    def parse_metrics(self, text: str) -> Load:
        # No /metrics; the agent never calls this (metrics_path is None).
        return Load()

    def parse_work(self, text: str) -> EngineWork:
        # Nothing to count from: the speed stays the start-up figure.
        return EngineWork()


ENGINE = SwiftEngine
