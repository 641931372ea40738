"""PEFT LoRA adapters with random small weights for a model folder's config.json (issue 36).

    python3 fleetgate_tools/bench/lora_adapters.py /tmp/vl/m7 /tmp/vl/loras --count 16 --rank 16
    python3 fleetgate_tools/bench/lora_adapters.py CONFIG_DIR OUT --config-only   # no torch

Writes OUT/a0 .. OUT/a<count-1>, each an `adapter_config.json` (peft_type LORA, r, lora_alpha,
target_modules q_proj,k_proj,v_proj,o_proj) and an `adapter_model.safetensors` with PEFT's
key names (`base_model.model.model.layers.<i>.self_attn.<m>.lora_A.weight`, shape
[r, in]; `lora_B.weight`, [out, r]). Shapes come from the config: q and o are hidden x
heads*head_dim, k and v hidden -> kv_heads*head_dim (Qwen2.5-7B: 3584, 28 heads, 4 KV heads,
head dim 128: q/o 3584 -> 3584, k/v 3584 -> 512). Both matrices are random (PEFT's
init_lora_weights=False), so every adapter changes the model's output and costs vLLM's LoRA
kernels their real work. Run as a file (the GPU machine has torch and safetensors with the
vLLM payload, not fleetgate's dependencies): it imports nothing of fleetgate.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def module_shapes(config: Mapping[str, Any], targets: Sequence[str] = TARGETS) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each attention projection named in targets."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    known = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
             "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden)}  # fmt: skip
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise ValueError(f"no shape for target modules {unknown}; known: {', '.join(known)}")
    return {t: known[t] for t in targets}


def tensor_shapes(config: Mapping[str, Any], rank: int,
                  targets: Sequence[str] = TARGETS) -> dict[str, tuple[int, int]]:  # fmt: skip
    """PEFT's safetensors key -> shape for every layer and target module."""
    out = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module, (fan_in, fan_out) in module_shapes(config, targets).items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            out[f"{key}.lora_A.weight"] = (rank, fan_in)
            out[f"{key}.lora_B.weight"] = (fan_out, rank)
    return out


def adapter_config(base: str, rank: int, alpha: int, targets: Sequence[str] = TARGETS) -> dict[str, Any]:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(targets), "fan_in_fan_out": False, "modules_to_save": None,
        "use_rslora": False, "use_dora": False, "inference_mode": True,
    }  # fmt: skip


def write_adapters(model_dir: Path, out: Path, *, count: int, rank: int, alpha: int, seed: int,
                   config_only: bool = False) -> list[Path]:  # fmt: skip
    config = json.loads((model_dir / "config.json").read_text())
    shapes = tensor_shapes(config, rank)
    written = []
    for i in range(count):
        folder = out / f"a{i}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps(adapter_config(str(model_dir), rank, alpha), indent=1))
        if not config_only:
            _weights(folder / "adapter_model.safetensors", shapes, seed + i)
        written.append(folder)
    return written


def _weights(path: Path, shapes: Mapping[str, tuple[int, int]], seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in shapes.items():
        # Small: the adapter nudges the random base model rather than swamping it.
        scale = 0.01 if key.endswith("lora_A.weight") else 0.001
        tensors[key] = (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16).contiguous()
    try:
        from safetensors.torch import save_file
    except ImportError:  # a payload without it: the format is a JSON header and raw bytes
        _save_bf16(tensors, path)
        return
    save_file(tensors, str(path), metadata={"format": "pt"})


def _save_bf16(tensors: Mapping[str, Any], path: Path) -> None:
    """safetensors' layout: u64 header size, JSON header (offsets into the data), data."""
    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for key, t in tensors.items():
        blob = t.view(torch.int16).numpy().tobytes()
        header[key] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head)
        for blob in blobs:
            fh.write(blob)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path, help="a folder with the base model's config.json")
    p.add_argument("out", type=Path)
    p.add_argument("--count", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config-only", action="store_true", help="adapter_config.json only (a simulator's)")
    args = p.parse_args(argv)
    folders = write_adapters(args.model_dir, args.out, count=args.count, rank=args.rank, alpha=args.alpha,
                             seed=args.seed, config_only=args.config_only)  # fmt: skip
    config = json.loads((args.model_dir / "config.json").read_text())
    mb = sum(a * b for a, b in tensor_shapes(config, args.rank).values()) * 2 / 2**20
    print(json.dumps({"adapters": len(folders), "out": str(args.out), "rank": args.rank,
                      "modules": module_shapes(config), "mib_each": 0 if args.config_only else round(mb, 1)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
