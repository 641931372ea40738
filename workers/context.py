"""The context length a real engine is started with, when the command line names none.

The model's own context (its config.json: max_position_embeddings), unless the card's KV
cache cannot hold one sequence that long; then the longest (in steps of 1024 tokens,
with a 10% margin for the estimate) that it can. The estimate: the memory the engine
gets for its cache (vLLM: the card x gpu_memory_utilization less the weights and ~2 GiB
of activations; LMDeploy: cache_max_entry_count of what the weights leave), over the KV
bytes of a token (layers x KV heads x head dim x K and V x the cache's element size).
A model folder without config.json (a hub name, say) keeps the old default, 4096, and
the plan says to set --max-model-len.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fleetgate.schema import GpuInfo

FALLBACK = 4096
GIB = 1024**3
_ACTIVATIONS = 2 * GIB
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4}


def read_config(model: str) -> dict[str, Any] | None:
    """The model folder's config.json (a multimodal model's text part where it has one)."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def model_context(config: dict[str, Any]) -> int | None:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def kv_bytes_per_token(config: dict[str, Any], element_bytes: float) -> float | None:
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return layers * kv_heads * head_dim * 2 * element_bytes


def weights_bytes(model: str, config: dict[str, Any]) -> float:
    """The weight files' size; for a config-only folder (`--load-format dummy`), an estimate
    from the shapes in bf16."""
    folder = Path(model)
    for pattern in ("*.safetensors", "*.bin"):
        files = list(folder.glob(pattern))
        if files:
            return float(sum(f.stat().st_size for f in files))
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config.get("intermediate_size") or 4 * hidden)
        vocab = int(config.get("vocab_size") or 0)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 0.0
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return 2.0 * (layers * (attention + 3 * hidden * inter) + embeddings)


def _element_bytes(engine: str, options: dict[str, Any], config: dict[str, Any]) -> float:
    if engine == "vllm" and str(options.get("kv_cache_dtype") or "auto").startswith("fp8"):
        return 1
    if engine == "lmdeploy":
        return {8: 1, 4: 0.5}.get(int(options.get("quant_policy") or 0), 2)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return _DTYPE_BYTES.get(dtype, 2)


def kv_capacity_tokens(
    engine: str, options: dict[str, Any], config: dict[str, Any], model: str, gpu: GpuInfo, cards: int,
) -> int | None:
    """About how many tokens the engine's KV cache holds on `cards` such cards (None: unknown)."""
    per_token = kv_bytes_per_token(config, _element_bytes(engine, options, config))
    if not per_token or not gpu.memory_mib:
        return None
    memory = gpu.memory_mib * 1024**2 * max(1, cards)
    weights = weights_bytes(model, config)
    if engine == "vllm":
        cache = memory * float(options.get("gpu_memory_utilization") or 0.9) - weights - _ACTIVATIONS
    elif engine == "lmdeploy":
        cache = (memory - weights) * float(options.get("cache_max_entry_count") or 0.8)
    else:
        return None
    return max(0, int(cache / per_token))


def default_max_model_len(
    engine: str, model: str, options: dict[str, Any], gpu: GpuInfo | None, cards: int,
) -> tuple[int, str]:
    """(max_model_len, why) for a real engine whose command line and card profile name none."""
    config = read_config(model)
    context = model_context(config) if config else None
    if config is None or context is None:
        return FALLBACK, (f"no context length in {Path(model) / 'config.json'}: max_model_len {FALLBACK} "
                          "(set --max-model-len for the model's own)")
    holds = kv_capacity_tokens(engine, options, config, model, gpu, cards) if gpu else None
    if holds is None or holds >= context:
        where = f"; the card's KV cache holds ~{holds:,} tokens" if holds is not None else ""
        return context, f"max_model_len {context}: the model's own context (config.json){where}"
    fitted = max(512, int(holds * 0.9) // 1024 * 1024)
    return fitted, (f"max_model_len {fitted}: the card's KV cache holds only ~{holds:,} tokens, "
                    f"less than the model's context {context} (config.json)")
