"""The spawner (scripts/spawn_worker.sh, `fleetgate spawn`): it checks before it detaches,
`--wait` reports how the start ended, and its plans (`--dry-run`) for adapters on LMDeploy
cards and for the context length."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetgate.net import free_port
from fleetgate.registry import Registry, connect
from tests.conftest import ROOT, Fleet, wait_until

SMI = ROOT / "tests" / "data" / "nvidia-smi"
MODEL = "spawn-model"


def spawn(*args: str, run_dir: Path | None = None, cli: bool = False, smi: str = "",
          timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """spawn_worker.sh (or `fleetgate spawn`, this checkout's) with `args`."""
    env = {**os.environ, "FLEETGATE_PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    if smi:
        env["FLEETGATE_NVIDIA_SMI_FILE"] = str(SMI / smi)
    head = [sys.executable, "-m", "fleetgate_tools.cli", "spawn"] if cli else ["bash", "scripts/spawn_worker.sh"]
    tail = ["--run-dir", str(run_dir)] if run_dir else []
    return subprocess.run([*head, *args, *tail], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _stop(run_dir: Path, worker_id: str) -> None:
    pid = int((run_dir / f"{worker_id}.pid").read_text())
    os.kill(pid, signal.SIGTERM)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"

    wait_until(gone, timeout=20)


async def _state(redis_url: str, prefix: str, worker_id: str) -> str | None:
    redis = connect(redis_url)
    try:
        view = await Registry(redis, prefix).read(worker_id)
        return view.state if view else None
    finally:
        await redis.aclose()


def test_unreachable_redis_fails_before_detaching(tmp_path: Path) -> None:
    """A Redis that does not answer is an error at once (exit 1, the URL named), not an agent
    looping in the background: nothing is started."""
    dead = f"redis://127.0.0.1:{free_port()}/0"
    out = spawn("--engine", "sim", "--model", MODEL, "--redis-url", dead, run_dir=tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert f"cannot reach Redis at {dead}" in out.stderr and "--redis-url" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_unresolvable_advertise_host_fails_before_detaching(redis_url: str, prefix: str, tmp_path: Path) -> None:
    """An --advertise-host that does not resolve is an error at once: gateways could never reach it."""
    out = spawn("--engine", "sim", "--model", MODEL, "--redis-url", redis_url, "--redis-prefix", prefix,
                "--advertise-host", "no-such-host.invalid", run_dir=tmp_path)
    assert out.returncode == 1 and out.stdout == ""
    assert "no-such-host.invalid" in out.stderr and "does not resolve" in out.stderr
    assert "--advertise-host" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_fleetgate_spawn_waits_until_the_worker_is_ready(
    fleet_factory: Callable[[], Fleet], tmp_path: Path,
) -> None:
    """`fleetgate spawn` returns once the worker is ready (exit 0), with progress lines on the way."""
    fleet = fleet_factory()
    out = spawn("--engine", "sim", "--model", MODEL, "--redis-url", fleet.redis_url,
                "--redis-prefix", fleet.prefix, cli=True, run_dir=tmp_path)
    worker_id = out.stdout.strip()
    try:
        assert out.returncode == 0, out.stderr
        assert asyncio.run(_state(fleet.redis_url, fleet.prefix, worker_id)) == "ready"
        # Progress lines on the way (which states it passes through depends on how fast the
        # agent registers: "not registered yet", "starting"), then the verdict.
        assert f"worker {worker_id}: " in out.stderr and f"worker {worker_id} ready after" in out.stderr
    finally:
        _stop(tmp_path, worker_id)


def test_wait_reports_a_failed_start_with_the_logs(fleet_factory: Callable[[], Fleet], tmp_path: Path) -> None:
    """spawn_worker.sh --wait on an engine whose warm-up fails: exit 1, saying so, with the last
    lines of the agent's and the engine's logs."""
    fleet = fleet_factory()
    out = spawn("--engine", "sim", "--model", MODEL, "--redis-url", fleet.redis_url, "--redis-prefix",
                fleet.prefix, "--option", "faults=error_rate=1.0", "--wait", run_dir=tmp_path)
    worker_id = out.stdout.strip()
    assert out.returncode == 1
    assert f"worker {worker_id} failed to start: its agent" in out.stderr
    assert "agent.start_failed" in out.stderr and "Simulated engine failure" in out.stderr
    assert f"lines of {tmp_path / worker_id}.engine.log" in out.stderr


# -- plans ---------------------------------------------------------------------------------


def _command(out: str) -> str:
    [command] = [line for line in out.splitlines() if line.strip() and not line.startswith("#")]
    return command


@pytest.mark.parametrize("card", ["t4.txt", "rtx4090.txt", "l4.txt"])
def test_auto_with_adapters_on_an_lmdeploy_card_picks_the_pytorch_backend(card: str) -> None:
    """TurboMind serves no LoRA: asking for adapters on a card whose profile says TurboMind
    plans LMDeploy's PyTorch backend instead, and says why."""
    out = spawn("--gpu", "0", "--model", "/models/m", "--adapters", "a=/lora/a", "--port", "8100", "--dry-run",
                smi=card)
    assert out.returncode == 0, out.stderr
    command = _command(out.stdout)
    assert "--backend pytorch" in command and "--adapters a=/lora/a" in command
    assert "adapters asked for: LMDeploy's PyTorch backend" in out.stdout


def test_explicit_turbomind_with_adapters_says_how_to_fix_it() -> None:
    """An explicit TurboMind with adapters is refused with the way out in the message."""
    out = spawn("--gpu", "0", "--model", "/models/m", "--adapters", "a=/lora/a", "--option", "backend=turbomind",
                "--port", "8100", "--dry-run", smi="t4.txt")
    assert out.returncode == 1
    assert "--option backend=pytorch" in out.stderr


def _model(tmp_path: Path, **config: object) -> Path:
    """A config-only model folder of a 7B-shaped model (as `--load-format dummy` uses)."""
    shape = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
             "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
             "torch_dtype": "bfloat16", "max_position_embeddings": 32768}
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**shape, **config}))
    return folder


def _max_len(out: str) -> int:
    match = re.search(r"--max-model-len (\d+)", _command(out))
    assert match, out
    return int(match[1])


def test_big_card_defaults_to_the_models_own_context(tmp_path: Path) -> None:
    """An H100 plans the model's own context (config.json), not 4096."""
    out = spawn("--gpu", "0", "--model", str(_model(tmp_path)), "--port", "8100", "--dry-run",
                smi="h100-80gb-hbm3.txt")
    assert out.returncode == 0, out.stderr
    assert _max_len(out.stdout) == 32768 and "the model's own context" in out.stdout


def test_a_context_the_card_cannot_hold_is_cut_to_what_it_holds(tmp_path: Path) -> None:
    """A 1M-token context does not fit an A100-40G's KV cache: the plan takes what fits, and says so."""
    model = _model(tmp_path, max_position_embeddings=1_048_576)
    out = spawn("--gpu", "0", "--model", str(model), "--port", "8100", "--dry-run", smi="a100-pcie-40gb.txt")
    assert out.returncode == 0, out.stderr
    holds = int(re.search(r"holds only ~([\d,]+) tokens", out.stdout)[1].replace(",", ""))  # type: ignore[index]
    assert 100_000 < holds < 1_048_576
    assert _max_len(out.stdout) <= 0.9 * holds and _max_len(out.stdout) % 1024 == 0


def test_without_a_config_the_plan_keeps_4096_and_says_how_to_change_it() -> None:
    """A model name with no config.json to read: 4096, and the plan names --max-model-len."""
    out = spawn("--gpu", "0", "--model", "/models/not-here", "--port", "8100", "--dry-run", smi="h200.txt")
    assert out.returncode == 0, out.stderr
    assert _max_len(out.stdout) == 4096 and "set --max-model-len" in out.stdout


def test_a_profiles_context_and_an_explicit_one_win(tmp_path: Path) -> None:
    """A card profile's max_model_len (T4: 2048) and --max-model-len come before the model's."""
    model = str(_model(tmp_path))
    out = spawn("--gpu", "0", "--model", model, "--port", "8100", "--dry-run", smi="t4.txt")
    assert "--session-len 2048" in _command(out.stdout)
    out = spawn("--gpu", "0", "--model", model, "--max-model-len", "8192", "--port", "8100", "--dry-run",
                smi="h100-80gb-hbm3.txt")
    assert _max_len(out.stdout) == 8192
