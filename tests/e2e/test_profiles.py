"""Card profiles: `spawn_worker.sh --gpu N --dry-run` on recorded nvidia-smi outputs of each card.

The outputs in tests/data/nvidia-smi/ stand in for nvidia-smi (FLEETGATE_NVIDIA_SMI_FILE
or `--nvidia-smi-output`), so every card's plan is checked on a machine without a GPU.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, Fleet, wait_until
from workers.gpu import load_profiles, parse_nvidia_smi, profile_for, query_gpus

SMI = ROOT / "tests" / "data" / "nvidia-smi"


def dry_run(card: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """spawn_worker.sh's plan for `card`'s recorded nvidia-smi output."""
    return subprocess.run(
        ["bash", "scripts/spawn_worker.sh", "--model", "/models/m", "--port", "8100", "--dry-run", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=check,
        env={**os.environ, "FLEETGATE_PYTHON": sys.executable,
             "FLEETGATE_NVIDIA_SMI_FILE": str(SMI / f"{card}.txt")},
    )


def commands(out: str) -> list[str]:
    """The engine command lines of a plan (everything that is not a `#` line)."""
    return [line for line in out.splitlines() if line.strip() and not line.startswith("#")]


# card file, --gpu, engine, flags that must appear, flags that must not
CARDS = [
    ("h200", "0", "vllm", ["--gpu-memory-utilization 0.9", "--max-num-seqs 512", "--kv-cache-dtype fp8",
                           "--enable-chunked-prefill"], []),
    ("h100-80gb-hbm3", "0", "vllm", ["--gpu-memory-utilization 0.9", "--max-num-seqs 256",
                                     "--kv-cache-dtype fp8"], []),
    ("a100-sxm4-80gb", "0", "vllm", ["--gpu-memory-utilization 0.9", "--max-num-seqs 256"], ["--kv-cache-dtype"]),
    ("a100-pcie-40gb", "0", "vllm", ["--gpu-memory-utilization 0.9", "--max-num-seqs 128"], ["--kv-cache-dtype"]),
    ("l40s", "0", "vllm", ["--gpu-memory-utilization 0.9", "--max-num-seqs 128", "--kv-cache-dtype fp8"], []),
    ("8x-h100-80gb-hbm3", "5", "vllm", ["CUDA_VISIBLE_DEVICES=5", "--kv-cache-dtype fp8"], ["--tensor-parallel-size"]),
    ("rtx4090", "0", "lmdeploy", ["--quant-policy 8", "--cache-max-entry-count 0.8", "--max-batch-size 64",
                                  "--backend turbomind", "--session-len 4096"], []),
    ("rtx3090", "0", "lmdeploy", ["--quant-policy 8", "--max-batch-size 48"], []),
    ("l4", "0", "lmdeploy", ["--quant-policy 8", "--cache-max-entry-count 0.8"], []),
    ("a10", "0", "lmdeploy", ["--quant-policy 8", "--cache-max-entry-count 0.8"], []),
    ("t4", "0", "lmdeploy", ["--quant-policy 4", "--session-len 2048", "--max-batch-size 16"], []),
]

ENGINE_MARK = {"vllm": "vllm_launcher.py serve", "lmdeploy": "-m lmdeploy serve api_server"}


@pytest.mark.parametrize(("card", "gpu", "engine", "present", "absent"), CARDS, ids=[c[0] for c in CARDS])
def test_each_card_gets_its_engine_and_tuning(
    card: str, gpu: str, engine: str, present: list[str], absent: list[str]
) -> None:
    """--engine auto picks vLLM on >= 40 GiB cards, LMDeploy on tight ones, with the profile's flags and why."""
    out = dry_run(card, "--gpu", gpu).stdout
    [command] = commands(out)
    assert ENGINE_MARK[engine] in command
    for flag in present:
        assert flag in command
    for flag in absent:
        assert flag not in command
    assert "# worker id: " in out and f"-gpu{gpu}-{engine}-8100" in out
    why = out.splitlines()[0]
    assert re.match(rf"# .+: profile \S+ -> {engine} \(.+\)$", why)


def test_profiles_match_the_recorded_cards_by_name_and_memory() -> None:
    """Each recorded card lands on its own profile, not a neighbour's (A10 is not A100, L4 is not L40S)."""
    profiles = load_profiles()
    chosen = {
        path.stem: profile_for(parse_nvidia_smi(path.read_text())[0], profiles).name
        for path in sorted(SMI.glob("*.txt")) if path.stem != "none"
    }
    assert chosen == {
        "2x-rtx4090": "rtx4090", "8x-h100-80gb-hbm3": "hopper", "a10": "a10", "a100-pcie-40gb": "a100-40g",
        "a100-sxm4-80gb": "a100-80g", "h100-80gb-hbm3": "hopper", "h200": "h200", "l4": "l4", "l40s": "l40s",
        "rtx3090": "rtx3090", "rtx4090": "rtx4090", "t4": "t4",
    }
    assert query_gpus(SMI / "none.txt") == []
    assert [g.index for g in query_gpus(SMI / "8x-h100-80gb-hbm3.txt")] == [str(i) for i in range(8)]


@pytest.mark.parametrize(
    ("card", "option", "flag", "replaced"),
    [
        ("t4", "quant_policy=8", "--quant-policy 8", "--quant-policy 4"),
        ("h100-80gb-hbm3", "kv_cache_dtype=auto", "--kv-cache-dtype auto", "--kv-cache-dtype fp8"),
        ("h200", "max-num-seqs=64", "--max-num-seqs 64", "--max-num-seqs 512"),
    ],
)
def test_option_overrides_a_profile_flag(card: str, option: str, flag: str, replaced: str) -> None:
    """--option KEY=VALUE wins over the card profile, and the plan says so."""
    out = dry_run(card, "--gpu", "0", "--option", option).stdout
    [command] = commands(out)
    assert flag in command and replaced not in command
    assert "overrides the profile's" in out


@pytest.mark.parametrize(
    ("card", "flag"),
    [("8x-h100-80gb-hbm3", "--tensor-parallel-size 2"), ("2x-rtx4090", "--tp 2")],
)
def test_two_gpus_give_tensor_parallel(card: str, flag: str) -> None:
    """--gpu 0,1 runs one engine over both cards: vLLM's --tensor-parallel-size, LMDeploy's --tp."""
    out = dry_run(card, "--gpu", "0,1").stdout
    [command] = commands(out)
    assert flag in command and "CUDA_VISIBLE_DEVICES=0,1" in command
    assert "# worker id: " in out and "-gpu0_1-" in out


def test_missing_gpu_is_an_error_on_a_machine_with_gpus() -> None:
    """Asking for a card nvidia-smi does not list fails, naming the cards it does list."""
    result = dry_run("8x-h100-80gb-hbm3", "--gpu", "0,9", check=False)
    assert result.returncode != 0 and "GPU 9 not found by nvidia-smi (it lists 0,1,2,3,4,5,6,7)" in result.stderr


def test_two_instances_split_one_card() -> None:
    """--instances 2 plans two engines on GPU 0, each with half the profile's memory, own port and id."""
    out = dry_run("h200", "--gpu", "0", "--instances", "2").stdout
    first, second = commands(out)
    group = re.search(r"^# worker id: (\S+)$", out, re.MULTILINE)
    assert group is not None
    assert f"worker id {group[1]}-0" in out and f"worker id {group[1]}-1" in out
    assert "gpu_memory_utilization 0.9 / 2 = 0.45 each" in out
    for command, port in ((first, 8100), (second, 8101)):
        assert "--gpu-memory-utilization 0.45" in command and f"--port {port}" in command
        assert "CUDA_VISIBLE_DEVICES=0" in command


def test_instances_keep_an_explicit_memory_share() -> None:
    """An explicit --option for the memory share is taken as each instance's, not divided again."""
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--engine", "lmdeploy", "--model", "/models/m", "--gpu", "0",
         "--port", "8200", "--instances", "2", "--nvidia-smi-output", str(SMI / "rtx4090.txt"),
         "--option", "cache_max_entry_count=0.3", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
    ).stdout
    assert [c.count("--cache-max-entry-count 0.3") for c in commands(out)] == [1, 1]
    assert "--quant-policy 8" in out


def test_instances_run_as_agents_that_stop_together(fleet_factory: Callable[[], Fleet]) -> None:
    """--instances 2 starts two registered workers; SIGTERM to the parent drains and stops both."""
    fleet = fleet_factory()
    _, url = fleet.gateway()
    parent = fleet.worker("pair", "--model", "pair-model", "--instances", "2", "--option", "time_scale=0.05")
    fleet.wait_ready(url, "pair-0", "pair-1", timeout=60)
    workers = fleet.workers(url)
    assert workers["pair-0"]["url"] != workers["pair-1"]["url"]
    seen = {
        httpx.post(f"{url}/v1/completions", json={"model": "pair-model", "prompt": f"p{i}", "max_tokens": 1},
                   timeout=10).headers["x-fleetgate-worker"]
        for i in range(12)
    }
    assert seen <= {"pair-0", "pair-1"}
    parent.send(signal.SIGTERM)
    assert parent.popen.wait(30) == 0
    wait_until(lambda: not {"pair-0", "pair-1"} & set(fleet.workers(url)), timeout=10)


def test_recorded_file_flag_equals_environment(tmp_path: Path) -> None:
    """--nvidia-smi-output FILE reads the same cards as FLEETGATE_NVIDIA_SMI_FILE."""
    out = subprocess.run(
        [sys.executable, "-m", "workers", "--gpu", "0", "--model", "/models/m", "--port", "8100",
         "--nvidia-smi-output", str(SMI / "t4.txt"), "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=True,
        env={k: v for k, v in os.environ.items() if k != "FLEETGATE_NVIDIA_SMI_FILE"},
    ).stdout
    assert commands(out) == commands(dry_run("t4", "--gpu", "0").stdout)


@pytest.mark.parametrize(
    ("gpu", "options", "low", "high"),
    [
        ("NVIDIA H100 80GB HBM3", {}, 1.0, 1.0),  # the reference card
        ("Tesla T4", {}, 0.15, 0.35),  # a memory-tight card: a fraction of an H100
        ("NVIDIA L40S", {}, 0.4, 0.8),
        ("Tesla T4", {"time_scale": 0.5}, 0.3, 0.7),  # a simulator run twice as fast
    ],
)
def test_workers_register_their_cards_speed(gpu: str, options: dict[str, float], low: float, high: float) -> None:
    """WorkerInfo.speed, what the gateway weighs a worker's batch by, follows the card's timing profile."""
    from fleetgate.schema import GpuInfo
    from workers.engines import EngineSpec
    from workers.speed import card_speed

    spec = EngineSpec(model="m", served_name="m", port=1, gpu=GpuInfo(name=gpu), options=dict(options))
    assert low <= card_speed(spec) <= high
