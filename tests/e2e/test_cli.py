"""The `fleetgate` CLI against a live test fleet, and its one-line errors when things are down."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleetgate.net import free_port
from fleetgate_tools.cli import app
from tests.conftest import ADMIN_TOKEN, Fleet, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "cli-model"
FLEETGATE = str(Path(sys.executable).parent / "fleetgate")


@pytest.fixture(scope="module")
def live(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    fleet = Fleet(redis_url, f"fgtest-{uuid.uuid4().hex[:10]}", tmp_path_factory.mktemp("cli"))
    try:
        _, url = fleet.gateway()
        fleet.worker("c-big", "--model", MODEL, "--sim-profile", "h100-7b", "--adapters", "fin=/a/fin")
        fleet.worker("c-small", "--model", MODEL, "--sim-profile", "t4-7b")
        fleet.wait_ready(url, "c-big", "c-small")
        yield fleet, url
    finally:
        fleet.close()


def run(*args: str, url: str, token: str = ADMIN_TOKEN) -> tuple[int, str, str]:
    env = {"FLEETGATE_URL": url, "FLEETGATE_ADMIN_TOKEN": token, "COLUMNS": "200"}
    result = CliRunner().invoke(app, list(args), env=env)
    return result.exit_code, result.stdout, result.stderr


def test_status_shows_the_fleet(live: tuple[Fleet, str]) -> None:
    """`fleetgate status` prints a table of both workers; --json prints the admin API's records."""
    _, url = live
    code, out, _ = run("status", url=url)
    assert code == 0, out
    assert "c-big" in out and "c-small" in out and "fin" in out and "2 workers (2 ready)" in out
    assert "x0.24" in out and "x1 " in out  # batch x speed: a T4 runs at a quarter of an H100
    code, out, _ = run("status", "--json", url=url)
    assert code == 0
    assert {w["id"]: w["state"] for w in json.loads(out)} == {"c-big": "ready", "c-small": "ready"}


def test_drain_and_undrain(live: tuple[Fleet, str]) -> None:
    """`drain` takes a worker out of routing and `undrain` puts it back, as the admin API shows."""
    fleet, url = live
    assert run("drain", "c-small", url=url)[:2] == (0, "c-small: drain done\n")
    assert fleet.workers(url)["c-small"]["state"] == "draining"
    assert run("undrain", "c-small", url=url)[0] == 0
    assert fleet.workers(url)["c-small"]["state"] == "ready"


def test_unknown_worker_and_wrong_token_are_one_line_errors(live: tuple[Fleet, str]) -> None:
    """A missing worker or a wrong token ends in one line that says what to check, exit status 1."""
    _, url = live
    code, _, err = run("drain", "no-such-worker", url=url)
    assert code == 1 and "No worker `no-such-worker` is registered" in err
    code, _, err = run("status", url=url, token="wrong")
    assert code == 1 and "refused the admin token" in err and "FLEETGATE_ADMIN_TOKEN" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run("status", url=url, token="")
    assert code == 1 and "no admin token" in err


def test_unreachable_gateway_names_the_url_without_a_traceback() -> None:
    """The installed `fleetgate` script reports a dead gateway URL in one line, no traceback."""
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [FLEETGATE, "status", "--gateway", url, "--token", "x"], capture_output=True, text=True, timeout=30,
    )
    assert proc.returncode == 1
    assert f"cannot reach the gateway at {url}/admin/workers" in proc.stderr
    assert "FLEETGATE_URL" in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


def test_gateway_without_redis_is_reported_as_such(live: tuple[Fleet, str]) -> None:
    """When the gateway cannot reach Redis, the CLI says so instead of 'internal error'."""
    fleet, _ = live
    _, url = fleet.gateway("--redis-url", f"redis://127.0.0.1:{free_port()}/0")
    code, _, err = run("status", url=url)
    assert code == 1 and "cannot reach its Redis registry" in err and "--redis-url" in err


def test_spawn_and_bench_pass_their_arguments_through() -> None:
    """`spawn` and `bench` hand every argument, --help included, to the scripts they wrap."""
    proc = subprocess.run([FLEETGATE, "spawn", "--engine", "sim", "--model", "m", "--dry-run"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "workers.simulator" in proc.stdout
    proc = subprocess.run([FLEETGATE, "spawn", "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "spawn_worker.sh --gpu 1" in proc.stdout
    proc = subprocess.run([FLEETGATE, "bench", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--workloads" in proc.stdout


def test_remove_deregisters_the_worker(live: tuple[Fleet, str]) -> None:
    """`remove` deregisters a worker; its agent stops and it stays gone."""
    fleet, url = live
    assert run("remove", "c-small", url=url)[0] == 0
    wait_until(lambda: "c-small" not in fleet.workers(url), timeout=10)
    code, out, _ = run("status", url=url)
    assert code == 0 and "c-small" not in out and "1 workers (1 ready)" in out
