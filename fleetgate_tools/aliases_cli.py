"""`fleetgate aliases` and `fleetgate fallbacks`: live routes through the admin API.

    fleetgate aliases set NAME MODEL=WEIGHT ...   e.g. `chat base-7b=90 tuned=10` (a bare MODEL: 1)
    fleetgate aliases list [--json] | rm NAME
    fleetgate fallbacks set MODEL FALLBACK ...    tried in order
    fleetgate fallbacks list [--json] | rm MODEL

Every replica follows a change within milliseconds (docs/operations.md, "Aliases and fallbacks").
"""

from __future__ import annotations

import json
from typing import Annotated, Any
from urllib.parse import quote

import typer
from rich.table import Table

from fleetgate_tools.admin_client import call as _call
from fleetgate_tools.admin_client import fail as _fail
from fleetgate_tools.cli_options import DEFAULT_URL, Gateway, Token, out

aliases_app = typer.Typer(help="Model aliases: a public name over weighted models.", no_args_is_help=True)
fallbacks_app = typer.Typer(help="Fallbacks: the models a request goes to when its own cannot serve it.",
                            no_args_is_help=True)

Json = Annotated[bool, typer.Option("--json", help="The raw records.")]


def _target(text: str) -> dict[str, Any]:
    model, sep, weight = text.rpartition("=")
    if not sep:
        return {"model": text, "weight": 1.0}
    try:
        return {"model": model, "weight": float(weight)}
    except ValueError:
        _fail(f"`{text}`: a target is MODEL=WEIGHT with a number for WEIGHT (or a bare MODEL, weight 1).")


@aliases_app.command("set")
def aliases_set(
    name: Annotated[str, typer.Argument(help="The alias: the model name clients send.")],
    targets: Annotated[list[str], typer.Argument(help="MODEL=WEIGHT ... (a bare MODEL weighs 1).")],
    gateway: Gateway = DEFAULT_URL, token: Token = "",
) -> None:
    """Create or replace an alias; its weights are relative to one another (0: no traffic)."""
    reply = _call(gateway, token, "PUT", f"/admin/aliases/{quote(name, safe='/')}",
                  {"targets": [_target(t) for t in targets]})
    shown = ", ".join(f"{t['model']}={t['weight']:g}" for t in reply["alias"]["targets"])
    out.print(f"alias {name} {'created' if reply.get('created') else 'updated'}: {shown}", highlight=False)


@aliases_app.command("list")
def aliases_list(json_out: Json = False, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Every alias in effect, with its weights and where it comes from (config or api)."""
    reply = _call(gateway, token, "GET", "/admin/aliases")
    if json_out:
        out.print_json(json.dumps(reply))
        return
    table = Table("Alias", "Targets", "Source")
    for a in reply["data"]:
        table.add_row(a["name"], ", ".join(f"{t['model']}={t['weight']:g}" for t in a["targets"]), a["source"])
    out.print(table)


@aliases_app.command("rm")
def aliases_rm(name: str, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Delete an alias (one from the config file too: it stays hidden until `aliases set`)."""
    _call(gateway, token, "DELETE", f"/admin/aliases/{quote(name, safe='/')}")
    out.print(f"alias {name} deleted")


@fallbacks_app.command("set")
def fallbacks_set(
    model: Annotated[str, typer.Argument(help="The model (or alias) whose requests fall back.")],
    fallbacks: Annotated[list[str], typer.Argument(help="The models to try next, in order.")],
    gateway: Gateway = DEFAULT_URL, token: Token = "",
) -> None:
    """Create or replace a model's fallback list."""
    reply = _call(gateway, token, "PUT", f"/admin/fallbacks/{quote(model, safe='/')}", {"models": fallbacks})
    verb = "created" if reply.get("created") else "updated"
    out.print(f"fallbacks of {model} {verb}: {' -> '.join(reply['fallback']['models'])}", highlight=False)


@fallbacks_app.command("list")
def fallbacks_list(json_out: Json = False, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Every fallback list in effect and where it comes from (config or api)."""
    reply = _call(gateway, token, "GET", "/admin/fallbacks")
    if json_out:
        out.print_json(json.dumps(reply))
        return
    table = Table("Model", "Fallbacks", "Source")
    for f in reply["data"]:
        table.add_row(f["model"], " -> ".join(f["models"]), f["source"])
    out.print(table)


@fallbacks_app.command("rm")
def fallbacks_rm(model: str, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Delete a model's fallback list (one from the config file too, until `fallbacks set`)."""
    _call(gateway, token, "DELETE", f"/admin/fallbacks/{quote(model, safe='/')}")
    out.print(f"fallbacks of {model} deleted")
