"""`fleetgate autoscale`: the command line of fleetgate_tools/autoscale_loop.py (cli.py registers it)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from fleetgate.logs import configure_logging
from fleetgate_tools.autoscale import Policy
from fleetgate_tools.autoscale_loop import DEFAULT_START, ROOT, Autoscaler, Options, parse_models


def _opt(help_: str, *names: str) -> typer.models.OptionInfo:
    return typer.Option(*names, help=help_)


def autoscale(
    model: Annotated[list[str], typer.Option(
        "--model", "-m", help="A model to scale (its base name, as /v1/models lists it); NAME=MIN:MAX "
        "overrides --min/--max for it. Repeatable.")],
    gateway: Annotated[str, typer.Option("--gateway", "-g", envvar="FLEETGATE_URL",
                                         help="Gateway base URL.")] = "http://127.0.0.1:8000",
    token: Annotated[str, typer.Option("--token", envvar="FLEETGATE_ADMIN_TOKEN", show_default=False,
                                       help="Admin token (prefer the environment variable).")] = "",
    start: Annotated[str, _opt("Command that starts one worker (bash; placeholders {model} {worker_id} "
                               "{port} {n}, shell-quoted). It may stay in the foreground (then retiring "
                               "SIGTERMs its process group) or detach.", "--start")] = DEFAULT_START,
    stop: Annotated[str, _opt("Command that stops a drained worker the autoscaler holds no running "
                              "process of (same placeholders). Default: the admin API's drain?stop=true, "
                              "which its agent obeys.", "--stop")] = "",
    min_workers: Annotated[int, _opt("Fewest workers per model.", "--min")] = 1,
    max_workers: Annotated[int, _opt("Most workers per model.", "--max")] = 4,
    up_saturation: Annotated[float, _opt("Add a worker at this saturation (in flight / slots).",
                                         "--up-saturation")] = 0.8,
    down_saturation: Annotated[float, _opt("Retire one when saturation stays at or below this.",
                                           "--down-saturation")] = 0.3,
    up_queue: Annotated[int, _opt("Add a worker when this many requests wait in the gateway's queue.",
                                  "--up-queue")] = 1,
    up_kv: Annotated[float, _opt("Add a worker at this KV use ratio.", "--up-kv")] = 0.9,
    up_cooldown: Annotated[float, _opt("Seconds between additions.", "--up-cooldown")] = 30.0,
    down_cooldown: Annotated[float, _opt("Seconds after any change before a retirement.",
                                         "--down-cooldown")] = 60.0,
    down_after: Annotated[float, _opt("Seconds the model must stay cold before a retirement.",
                                      "--down-after")] = 60.0,
    step: Annotated[int, _opt("Most workers added at once.", "--step")] = 1,
    interval: Annotated[float, _opt("Seconds between polls of the signal.", "--interval")] = 1.0,
    settle: Annotated[float, _opt("Seconds a drained worker must be idle before it is stopped.",
                                  "--settle")] = 1.0,
    start_timeout: Annotated[float, _opt("Seconds a new worker may take to be ready.", "--start-timeout")] = 300.0,
    stop_timeout: Annotated[float, _opt("Seconds a stopped worker may take to leave the registry.",
                                        "--stop-timeout")] = 120.0,
    id_prefix: Annotated[str, _opt("Prefix of the worker ids it gives, and of those it may retire.",
                                   "--id-prefix")] = "autoscale-",
    log_dir: Annotated[Path, _opt("Where the start commands' output goes.", "--log-dir")] = ROOT / ".run" / "autoscale",
    json: Annotated[bool | None, typer.Option("--json/--no-json", help="JSON events (default: when "
                                              "stderr is not a terminal).", show_default=False)] = None,
) -> None:
    """Add and retire workers on load, from the gateway's scaling signal (GET /admin/scaling)."""
    configure_logging(json=json)
    if not token:
        typer.echo("fleetgate: no admin token: set FLEETGATE_ADMIN_TOKEN or pass --token.", err=True)
        raise typer.Exit(1)
    try:
        base = Policy(min_workers=min_workers, max_workers=max_workers, up_saturation=up_saturation,
                      down_saturation=down_saturation, up_queue=up_queue, up_kv=up_kv,
                      up_cooldown_s=up_cooldown, down_cooldown_s=down_cooldown, down_after_s=down_after,
                      step=step)
        policies = parse_models(model, base)
        scaler = Autoscaler(Options(
            gateway=gateway, token=token, policies=policies, start=start, stop=stop, interval_s=interval,
            settle_s=settle, start_timeout_s=start_timeout, stop_timeout_s=stop_timeout,
            id_prefix=id_prefix, log_dir=log_dir,
        ))
    except ValueError as exc:
        typer.echo(f"fleetgate: {exc}", err=True)
        raise typer.Exit(1) from None
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    scaler.run(stop=lambda: bool(stopping))
