"""compose.yaml: valid against the Compose schema, and its commands in step with the real command lines.

No Docker engine runs here, so the file is checked the way `docker compose config`
would (schema) and its commands the way the programs would take them (`--help`, and
the workers' own `--dry-run`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.conftest import run_module

ROOT = Path(__file__).resolve().parents[2]
SMI_H100 = ROOT / "tests" / "data" / "nvidia-smi" / "h100-80gb-hbm3.txt"
# spawn_worker.sh's own flags; it passes every other one to `python -m workers`.
SPAWNER_FLAGS = {"--foreground", "--dry-run", "--run-dir", "--port"}


@cache
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())  # type: ignore[no-any-return]


def interpolate(arg: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR:?message}` with nothing set in the environment."""
    return re.sub(r"\$\{(\w+)(?::?-([^}]*)|:\?[^}]*)?\}", lambda m: m.group(2) or "x", arg)


@cache
def help_flags(module: str) -> frozenset[str]:
    proc = run_module(module, "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out))


def flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def commands() -> dict[str, list[str]]:
    return {
        name: [interpolate(str(a)) for a in svc["command"]]
        for name, svc in compose()["services"].items() if name != "redis"
    }


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    """compose.yaml validates against the compose-spec JSON schema (docker-compose 1.29.2's copy)."""
    schema = json.loads((ROOT / "tests" / "data" / "compose_spec.json").read_text())
    # Its $schema names draft 2019-09 by a URL jsonschema does not know; say so directly.
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []
    broken = {"services": {"gateway": {"image": "x", "comand": ["python"]}}}
    assert not validator.is_valid(broken)  # the schema does reject unknown keys


def test_profiles_split_gpu_workers_from_the_simulated_stack() -> None:
    """Redis and the gateway always run; `gpu` workers reserve NVIDIA cards, `sim` workers need none."""
    services = compose()["services"]
    always = {n for n, s in services.items() if "profiles" not in s}
    assert always == {"redis", "gateway"}
    gpu = {n for n, s in services.items() if s.get("profiles") == ["gpu"]}
    sim = {n for n, s in services.items() if s.get("profiles") == ["sim"]}
    assert len(gpu) >= 1 and len(sim) >= 2 and always | gpu | sim == set(services)
    for name in gpu:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    for name in sim:
        assert "deploy" not in services[name]
        assert commands()[name][:5] == ["python", "-m", "workers", "--engine", "sim"]
    assert all(services[n]["depends_on"]["redis"]["condition"] == "service_healthy" for n in gpu | sim)


def test_gateway_command_uses_only_flags_the_gateway_accepts() -> None:
    """The gateway service runs `python -m gateway` with flags from its --help."""
    argv = commands()["gateway"]
    assert argv[:3] == ["python", "-m", "gateway"]
    assert flags(argv) - help_flags("gateway") == set()
    assert "--host" in argv and argv[argv.index("--host") + 1] == "0.0.0.0"


@pytest.mark.parametrize("name", sorted(n for n in compose()["services"] if n != "redis" and n != "gateway"))
def test_worker_commands_are_accepted_and_dry_run(name: str) -> None:
    """Every worker service's command uses known flags and its agent's --dry-run plans an engine."""
    argv = commands()[name]
    if argv[0] == "scripts/spawn_worker.sh":
        assert (ROOT / argv[0]).exists() and "--foreground" in argv
        assert flags(argv) - SPAWNER_FLAGS - help_flags("workers") == set()
        run = ["bash", *argv, "--dry-run", "--nvidia-smi-output", str(SMI_H100)]
    else:
        assert argv[:3] == ["python", "-m", "workers"]
        assert flags(argv) - help_flags("workers") == set()
        run = [sys.executable, *argv[1:], "--dry-run"]
    proc = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "FLEETGATE_PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    worker_id = argv[argv.index("--id") + 1]
    assert f"# worker id: {worker_id}" in proc.stdout
    assert "--host 0.0.0.0" in proc.stdout
