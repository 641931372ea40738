"""Which card is this, and which engine and settings suit it (config/workers.yaml)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import yaml

from fleetgate.schema import GpuInfo

QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
# A file holding QUERY's output, read instead of running nvidia-smi (tests, dry runs
# for another machine). `python -m workers --nvidia-smi-output FILE` sets the same.
SMI_FILE_ENV = "FLEETGATE_NVIDIA_SMI_FILE"
DEFAULT_PROFILES = Path(__file__).resolve().parent.parent / "config" / "workers.yaml"


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """Rows of `nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        memory = re.sub(r"[^0-9]", "", parts[2]) or "0"
        gpus.append(GpuInfo(index=parts[0], name=parts[1], memory_mib=int(memory)))
    return gpus


def query_gpus(recorded: str | Path | None = None) -> list[GpuInfo]:
    """The cards nvidia-smi sees; empty when there is no driver or no card.

    `recorded` (else $FLEETGATE_NVIDIA_SMI_FILE) names a file with nvidia-smi's output
    to read instead: what another machine would report.
    """
    recorded = recorded or os.environ.get(SMI_FILE_ENV)
    if recorded:
        return parse_nvidia_smi(Path(recorded).read_text())
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_nvidia_smi(out)


class CardProfile(msgspec.Struct, kw_only=True):
    name: str
    match: str = ""
    min_memory_gib: float = 0
    engine: str = "vllm"
    sim_profile: str = "l40s-7b"
    max_model_len: int | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    why: str = ""


class ProfileFile(msgspec.Struct, kw_only=True):
    # Cards at or above this memory run vLLM; below it LMDeploy.
    vllm_min_memory_gib: float = 40
    cards: list[CardProfile] = msgspec.field(default_factory=list)


def load_profiles(path: str | Path = DEFAULT_PROFILES) -> ProfileFile:
    data = yaml.safe_load(Path(path).read_text()) if Path(path).exists() else {}
    return msgspec.convert(data or {}, ProfileFile)


def profile_for(gpu: GpuInfo, profiles: ProfileFile) -> CardProfile:
    """The first card profile whose name pattern and memory floor match this card."""
    memory_gib = gpu.memory_mib / 1024
    for card in profiles.cards:
        if card.match and not re.search(card.match, gpu.name, re.IGNORECASE):
            continue
        if memory_gib + 0.5 < card.min_memory_gib:
            continue
        return card
    engine = "vllm" if memory_gib >= profiles.vllm_min_memory_gib else "lmdeploy"
    return CardProfile(
        name="generic", engine=engine,
        why=f"no profile matches {gpu.name}; {memory_gib:.0f} GiB "
        f"{'>=' if engine == 'vllm' else '<'} {profiles.vllm_min_memory_gib:.0f} GiB -> {engine}",
    )
