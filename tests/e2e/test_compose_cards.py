"""compose.yaml's GPU services on every card we know: the command as written, dry-run on
each card's recorded nvidia-smi output, plans the engine the card's profile names, with
the settings that let it start (adapters on an LMDeploy card: the PyTorch backend,
since TurboMind serves no LoRA).

tests/e2e/test_compose.py checks the flags and one card (an H100); this covers the rest.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from workers.gpu import load_profiles, parse_nvidia_smi, profile_for

ROOT = Path(__file__).resolve().parents[2]
SMI = ROOT / "tests" / "data" / "nvidia-smi"
CARDS = sorted(p.name for p in SMI.glob("*.txt") if parse_nvidia_smi(p.read_text()))


@cache
def services() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]  # type: ignore[no-any-return]


def gpu_services() -> list[str]:
    return sorted(n for n, s in services().items() if s.get("profiles") == ["gpu"])


def interpolate(arg: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR:?message}` with nothing set in the environment."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*)|:\?[^}]*)?\}", lambda m: m.group(2) or "x", arg)


def dry_run(service: str, card: str) -> tuple[list[str], list[str]]:
    """The service's command with --dry-run on `card`: (its `# ...` reasons, the engine's argv)."""
    argv = [interpolate(str(a)) for a in services()[service]["command"]]
    assert argv[0] == "scripts/spawn_worker.sh"
    proc = subprocess.run(["bash", *argv, "--dry-run", "--nvidia-smi-output", str(SMI / card)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "FLEETGATE_PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    words = shlex.split(lines[-1])
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # the engine's environment
        words.pop(0)
    return [line for line in lines if line.startswith("# ")], words


def test_every_card_file_is_covered() -> None:
    """The card files span both engines, so the dry runs below see vLLM and LMDeploy cards."""
    profiles = load_profiles()
    engines = {profile_for(parse_nvidia_smi((SMI / c).read_text())[0], profiles).engine for c in CARDS}
    assert engines == {"vllm", "lmdeploy"} and len(CARDS) >= 10


@pytest.mark.parametrize("card", CARDS)
@pytest.mark.parametrize("service", gpu_services())
def test_gpu_service_plans_an_engine_that_starts_on_each_card(service: str, card: str) -> None:
    """The service's command, as written, plans the card profile's engine with settings it can start with."""
    gpu = parse_nvidia_smi((SMI / card).read_text())[0]
    profile = profile_for(gpu, load_profiles())
    why, engine = dry_run(service, card)
    command = " ".join(engine)
    args = [interpolate(str(a)) for a in services()[service]["command"]]
    adapters = args[args.index("--adapters") + 1] if "--adapters" in args else ""
    assert any(f"profile {profile.name} -> {profile.engine}" in line for line in why), why
    port = args[args.index("--port") + 1]
    assert re.search(rf"--(server-)?port {port}\b", command), command
    if profile.engine == "lmdeploy":
        assert engine[1:5] == ["-m", "lmdeploy", "serve", "api_server"]
        assert "--server-name 0.0.0.0" in command
        if adapters:
            # TurboMind serves no LoRA adapters: with adapters the card runs the PyTorch backend.
            assert "--backend pytorch" in command and f"--adapters {adapters.replace(',', ' ')}" in command
            assert any("PyTorch backend" in line for line in why)
        else:
            assert f"--backend {profile.options.get('backend', 'turbomind')}" in command
        assert f"--session-len {profile.max_model_len}" in command
    else:
        assert "serve" in engine and "--host 0.0.0.0" in command
        if adapters:
            assert "--enable-lora" in command and "--lora-modules" in command
