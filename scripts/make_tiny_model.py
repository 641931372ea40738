"""Makes a tiny Qwen2-shaped chat model and a LoRA for it, offline, for tests against the real vLLM.

    .venv-vllm/bin/python scripts/make_tiny_model.py OUT_DIR

Writes OUT_DIR/model (tokenizer + config + random weights, ~1.6 MB) and OUT_DIR/lora
(a rank-8 adapter on q_proj/v_proj). No hub is reachable from our machines, so the
tokenizer is trained here on Python's own stdlib sources. Seeds are fixed, so a rerun
on the same Python gives the same files. Skips the work when both folders are there.
Run it with vLLM's venv (scripts/setup_vllm.sh): it needs torch, transformers,
tokenizers and peft, none of which the project's own venv carries.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SEED = 1234
VOCAB_SIZE = 4096
# The standard Qwen2 ChatML template, so transformers' apply_chat_template (and vLLM)
# handle add_generation_prompt and continue_final_message like they do for real models.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# transformers' Qwen2Tokenizer's pre-tokenizing split (tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def corpus_files(limit: int = 120) -> list[str]:
    """Stdlib sources in a stable order: the same text on every machine with this Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(str(p) for p in stdlib.glob("*.py"))
    return files[:limit]


def make_tokenizer(out: Path):  # type: ignore[no-untyped-def]
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    # The pipeline transformers' Qwen2Tokenizer builds (the class config.json's model type picks),
    # whatever tokenizer.json says: written into tokenizer.json too, so that what reads the file
    # alone (the gateway, the simulator) splits text as vLLM does (digits one by one).
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def make_model(out: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",
    )
    torch.manual_seed(SEED)
    # bf16 as vLLM serves it on CPU anyway; halves the files (~1.6 MB).
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)


def make_lora(model_dir: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(SEED + 1)
    base = Qwen2ForCausalLM.from_pretrained(model_dir)
    # init_lora_weights=False: random A and B, so the adapter really changes the outputs
    # (the default zero B would make it an exact copy of the base model).
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=False,
    )
    peft_model = get_peft_model(base, config)
    # base_model_name_or_path is informational; keep it free of this machine's paths.
    peft_model.peft_config["default"].base_model_name_or_path = "tiny"
    with warnings.catch_warnings():
        # peft looks for the base config under that name to see if the vocabulary changed.
        warnings.filterwarnings("ignore", message="Could not find a config file")
        peft_model.save_pretrained(out)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[1]).resolve()
    model_dir, lora_dir = out / "model", out / "lora"
    if (model_dir / "config.json").exists() and (lora_dir / "adapter_config.json").exists():
        print(f"make_tiny_model: {out} already has model/ and lora/")
        return 0
    started = time.monotonic()
    # Build beside the target and move into place, so an interrupted run leaves no
    # half-written folder that a later run would take as done.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = make_tokenizer(tmp / "model")
    make_model(tmp / "model", tokenizer)
    make_lora(tmp / "model", tmp / "lora")
    out.mkdir(parents=True, exist_ok=True)
    for part in ("model", "lora"):
        shutil.rmtree(out / part, ignore_errors=True)
        (tmp / part).rename(out / part)
    tmp.rmdir()
    print(
        f"make_tiny_model: wrote {model_dir} (vocab {len(tokenizer)}) and {lora_dir} "
        f"in {time.monotonic() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
