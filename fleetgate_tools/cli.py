"""`fleetgate`: the operator's command line.

    fleetgate status                 the fleet as a table (--json for the raw records)
    fleetgate drain|undrain|remove ID
    fleetgate spawn --gpu 0 ...      scripts/spawn_worker.sh --wait, arguments passed through
    fleetgate bench ...              scripts/bench_fleet.py, arguments passed through
    fleetgate autoscale --model M    add and retire workers on load (fleetgate_tools/autoscale_loop.py)
    fleetgate keys add|list|rm       API keys and their limits; `teams set|list|rm` (docs/tenants.md)
    fleetgate usage [--key K] [--days N]   usage per key and model (fleetgate_tools/tenants_cli.py)
    fleetgate aliases set NAME MODEL=WEIGHT ... | list | rm NAME     live aliases; `fallbacks set
              MODEL FALLBACK ... | list | rm MODEL` (fleetgate_tools/aliases_cli.py)

`--gateway` (FLEETGATE_URL) and `--token` (FLEETGATE_ADMIN_TOKEN) say which gateway
and how to authenticate. Failures are one line on stderr that says what failed and
what to check, and exit status 1; never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table

from fleetgate_tools.admin_client import Admin, CliError
from fleetgate_tools.admin_client import fail as _fail
from fleetgate_tools.aliases_cli import aliases_app, fallbacks_app
from fleetgate_tools.autoscale_cli import autoscale
from fleetgate_tools.cli_options import DEFAULT_URL, Gateway, Token, out
from fleetgate_tools.tenants_cli import keys_app, teams_app, usage

ROOT = Path(__file__).resolve().parent.parent

app = typer.Typer(
    name="fleetgate", help="Operate a fleetgate fleet through a gateway's admin API.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)

WorkerId = Annotated[str, typer.Argument(help="Worker id, as `fleetgate status` shows it.")]


def _call(gateway: str, token: str, method: str, path: str) -> Any:
    """One admin call; its client's connections are closed afterwards."""
    with Admin(gateway, token) as admin:
        return admin.call(method, path)


# -- commands ---------------------------------------------------------------------------


def _gpu(w: dict[str, Any]) -> str:
    gpu = w.get("gpu") or {}
    if not gpu:
        return "-"
    mem = gpu.get("memory_mib") or 0
    return f"{gpu.get('name', '?')} {mem // 1024}G" if mem else str(gpu.get("name", "?"))


def _circuit(w: dict[str, Any]) -> str | None:
    value = w.get("circuit", w.get("circuit_state"))
    if value is None:
        return None
    return str(value.get("state", value)) if isinstance(value, dict) else str(value)


_STATE_STYLE = {"ready": "green", "draining": "yellow", "starting": "cyan", "unhealthy": "red"}


def fleet_table(workers: list[dict[str, Any]]) -> Table:
    with_circuit = any(_circuit(w) is not None for w in workers)
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (
        ("ID", "left"), ("STATE", "left"), ("ENGINE", "left"), ("MODEL", "left"),
        ("ADAPTERS", "left"), ("GPU", "left"), ("BATCHxSPEED", "right"), ("HOST", "left"), ("RUN/WAIT", "right"),
        ("KV", "right"), ("INFLIGHT", "right"), *((("CIRCUIT", "left"),) if with_circuit else ()),
        ("HEARTBEAT", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=name in ("ID", "STATE"))  # type: ignore[arg-type]
    for w in sorted(workers, key=lambda w: str(w["id"])):
        load = w.get("load") or {}
        state = str(w.get("state", "?"))
        age = w.get("heartbeat_age_s")
        table.add_row(
            str(w["id"]), f"[{_STATE_STYLE.get(state, 'white')}]{state}[/]", str(w.get("engine", "")),
            str(w.get("model", "")), ", ".join(w.get("adapters") or []) or "-", _gpu(w),
            f"{w.get('capacity', '?')}x{float(w.get('speed', 1.0)):g}", str(w.get("host") or "-"), f"{load.get('running', 0)}/{load.get('waiting', 0)}",
            f"{float(load.get('kv_cache_usage', 0)) * 100:.0f}%", str(load.get("inflight", 0)),
            *((_circuit(w) or "-",) if with_circuit else ()),
            f"{age:.1f}s" if isinstance(age, int | float) else "-",
        )
    return table


@app.command()
def status(
    gateway: Gateway = DEFAULT_URL, token: Token = "",
    json: Annotated[bool, typer.Option("--json", help="Print the raw /admin/workers records.")] = False,
) -> None:
    """Show every registered worker: state, engine, model, adapters, GPU and load."""
    try:
        workers = _call(gateway, token, "GET", "/admin/workers")["data"]
    except CliError as exc:
        _fail(str(exc))
    if json:
        out.print_json(data=workers)
        return
    if not workers:
        out.print(f"No workers registered at {gateway}. Start one with `fleetgate spawn`.")
        return
    out.print(fleet_table(workers))
    by_state: dict[str, int] = {}
    for w in workers:
        by_state[w["state"]] = by_state.get(w["state"], 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(by_state.items()))
    out.print(f"\n{len(workers)} workers ({summary}) at {gateway}, {time.strftime('%H:%M:%S')}")


def _write(action: str, worker_id: str, gateway: str, token: str) -> None:
    method, path = ("DELETE", f"/admin/workers/{worker_id}") if action == "remove" else (
        "POST", f"/admin/workers/{worker_id}/{action}"
    )
    try:
        _call(gateway, token, method, path)
    except CliError as exc:
        _fail(str(exc))
    out.print(f"{worker_id}: {action} done")


@app.command()
def drain(worker_id: WorkerId, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Stop routing new requests to a worker, on every gateway; in-flight ones finish."""
    _write("drain", worker_id, gateway, token)


@app.command()
def undrain(worker_id: WorkerId, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Put a drained worker back into routing."""
    _write("undrain", worker_id, gateway, token)


@app.command()
def remove(worker_id: WorkerId, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Deregister a worker; its agent, if still running, stops its engine and exits."""
    _write("remove", worker_id, gateway, token)


_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _run_script(argv: list[str], script: Path) -> NoReturn:
    if not script.exists():
        _fail(f"{script} is missing: `fleetgate {script.stem}` runs from a fleetgate checkout.")
    env = {**os.environ}
    env.setdefault("FLEETGATE_PYTHON", sys.executable)  # the spawner's agent uses this interpreter
    try:
        rc = subprocess.call(argv, cwd=ROOT, env=env)
    except KeyboardInterrupt:
        rc = 130
    raise typer.Exit(rc)


# Arguments after which spawn_worker.sh neither detaches nor waits.
_NO_WAIT = {"--no-wait", "--dry-run", "--foreground", "-h", "--help"}


@app.command(context_settings=_PASS_THROUGH)
def spawn(ctx: typer.Context) -> None:
    """Start a worker agent and wait until it is ready or its start failed: scripts/spawn_worker.sh
    --wait with these arguments (`--no-wait` returns once it is started; try `spawn --help`)."""
    script = ROOT / "scripts" / "spawn_worker.sh"
    wait = [] if _NO_WAIT & set(ctx.args) else ["--wait"]
    _run_script(["bash", str(script), *wait, *ctx.args], script)


@app.command(context_settings=_PASS_THROUGH)
def bench(ctx: typer.Context) -> None:
    """Benchmark routing policies: scripts/bench_fleet.py with these arguments (try `bench --help`)."""
    script = ROOT / "scripts" / "bench_fleet.py"
    _run_script([sys.executable, str(script), *ctx.args], script)


app.command()(autoscale)
app.add_typer(keys_app, name="keys")
app.add_typer(teams_app, name="teams")
app.add_typer(aliases_app, name="aliases")
app.add_typer(fallbacks_app, name="fallbacks")
app.command()(usage)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
