"""Mistyped settings fail loudly: `python -m gateway` and `python -m workers` run as real
processes, and each mistake ends them at once with exit status 2 and one line that names
the bad key or value and what is allowed, never a traceback. (They are started from the
tests' fork server, tests/forkserver.py: the interpreter's start-up is shared, the run is not.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_module


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m ...` as a real process (from the tests' fork server: tests/conftest.py)."""
    assert argv[0] == "-m"
    return run_module(*argv[1:])


def _config(tmp_path: Path, gateway: dict[str, object]) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump({"gateway": gateway}))
    return str(path)


def _refused(out: subprocess.CompletedProcess[str], *wanted: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and out.stdout == ""
    [line] = [x for x in out.stderr.splitlines() if "error:" in x]
    for text in wanted:
        assert text in line, line


def test_unknown_policy_names_the_known_ones() -> None:
    """`--policy fleett`: the policies there are, and the one probably meant."""
    _refused(_run("-m", "gateway", "--policy", "fleett"),
             "unknown routing policy `fleett`", "did you mean `fleet`?", "least_outstanding, random, round_robin")


@pytest.mark.parametrize("policy", ["fleet", "round_robin"])
def test_unknown_routing_knob_in_the_config_file(tmp_path: Path, policy: str) -> None:
    """A misspelled knob fails whatever the policy (round_robin used to ignore it silently)."""
    config = _config(tmp_path, {"policy": policy, "routing": {"balanc": 0.3}})
    _refused(_run("-m", "gateway", "--config", config),
             "unknown routing knob `routing.balanc`", "did you mean `balance`?", "kv_high")


@pytest.mark.parametrize(
    ("gateway", "wanted"),
    [
        ({"polcy": "fleet"}, ("unknown setting `polcy`", "gateway.yaml", "did you mean `policy`?")),
        ({"routing": {"kv_high": "high"}}, ("bad setting `routing.kv_high`", "expected `bool | int | float`, got `str`")),
        ({"rate_limit_rpm": "many"}, ("bad setting `rate_limit_rpm`", "expected `float`", "'many'")),
        ({"aliases": {"chat": [{"model": "m", "wieght": 2}]}},
         ("bad setting `aliases.chat[0]`", "unknown field `wieght`", "fields: model, weight")),
        ({"aliases": {"chat": [{"model": "m", "weight": 0}]}}, ("alias `chat`", "must be above 0")),
        ({"fallbacks": {"a": ["a"]}}, ("`a` names itself as its fallback",)),
        ({"log_level": "verbose"}, ("unknown `log_level` `verbose`", "debug")),
    ],
)
def test_bad_values_in_the_config_file(tmp_path: Path, gateway: dict[str, object], wanted: tuple[str, ...]) -> None:
    """Unknown keys, wrong types and impossible aliases: the key's full path and what fits."""
    _refused(_run("-m", "gateway", "--config", _config(tmp_path, gateway)), *wanted)


def test_a_config_file_that_is_not_yaml(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("gateway:\n  policy: [fleet\n")
    _refused(_run("-m", "gateway", "--config", str(path)), "is not valid YAML")


@pytest.mark.parametrize(
    ("argv", "wanted"),
    [
        (("--engine", "simm"), ("unknown --engine 'simm'", "did you mean 'sim'?", "vllm")),
        (("--engine", "sim", "--option", "time_scal=0.1"),
         ("unknown --option for the sim engine: 'time_scal'", "did you mean 'time_scale'?", "max_num_seqs")),
        (("--engine", "sim", "--option", "time_scale"), ("--option needs KEY=VALUE",)),
        (("--engine", "external", "--url", "http://127.0.0.1:1", "--flavor", "vlm"), ("unknown --flavor 'vlm'",)),
    ],
)
def test_agent_options_fail_loudly(argv: tuple[str, ...], wanted: tuple[str, ...]) -> None:
    """The agent refuses an unknown engine, flavour or engine option before starting anything."""
    _refused(_run("-m", "workers", *argv, "--dry-run"), *wanted)


def test_known_agent_options_still_work() -> None:
    out = _run("-m", "workers", "--engine", "sim", "--option", "time_scale=0.1", "--option", "max_num_seqs=8",
               "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "--time-scale 0.1" in out.stdout and "--max-num-seqs 8" in out.stdout
