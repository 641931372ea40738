"""`fleetgate keys`, `fleetgate teams` and `fleetgate usage`: tenants through the admin API.

    fleetgate keys add ID [--team T] [--rpm N] [--tpm N] [--budget N --period day|total]
                          [--priority P] [--model M ...] [--rotate]   prints a new secret once
    fleetgate keys list | rm ID
    fleetgate teams set ID [--rpm N] [--tpm N] [--budget N --period day|total] | list | rm ID
    fleetgate usage [--key K] [--model M] [--day YYYY-MM-DD] [--days N] [--json]
"""

from __future__ import annotations

import json
from typing import Annotated, Any
from urllib.parse import urlencode

import typer
from rich.table import Table

from fleetgate_tools.admin_client import call as _call
from fleetgate_tools.admin_client import fail as _fail
from fleetgate_tools.cli_options import DEFAULT_URL, Gateway, Token, out

keys_app = typer.Typer(help="API keys and their limits (docs/tenants.md).", no_args_is_help=True)
teams_app = typer.Typer(help="Teams: limits their keys share.", no_args_is_help=True)

Rpm = Annotated[float, typer.Option(help="Requests per minute (0: no limit).")]
Tpm = Annotated[float, typer.Option(help="Tokens per minute, input + output (0: no limit).")]
Budget = Annotated[int, typer.Option(help="Token budget per --period (0: none).")]
Period = Annotated[str, typer.Option(help="day (UTC) or total.")]
Burst = Annotated[float, typer.Option(help="Seconds of the per-minute limit that may come at once.")]


def _limits(rpm: float, tpm: float, budget: int, period: str, burst_s: float) -> dict[str, Any]:
    if period not in ("day", "total"):
        _fail(f"--period is day or total, not {period!r}.")
    return {"rpm": rpm, "tpm": tpm, "budget_tokens": budget, "budget_period": period, "burst_s": burst_s}


def _fmt(value: float) -> str:
    return f"{value:g}" if value else "-"


@keys_app.command("add")
def keys_add(
    key_id: Annotated[str, typer.Argument(help="The key's id: a name, shown in logs, metrics and usage.")],
    team: Annotated[str, typer.Option(help="The team whose limits it shares.")] = "",
    rpm: Rpm = 0, tpm: Tpm = 0, budget: Budget = 0, period: Period = "day", burst_s: Burst = 60.0,
    priority: Annotated[str, typer.Option(help="Priority class.")] = "default",
    model: Annotated[list[str] | None, typer.Option(help="A model it may use (repeat; none: all).")] = None,
    rotate: Annotated[bool, typer.Option(help="Give an existing key a new secret.")] = False,
    gateway: Gateway = DEFAULT_URL, token: Token = "",
) -> None:
    """Create (or replace) a key; a new key's secret is printed once, and never stored."""
    body = {**_limits(rpm, tpm, budget, period, burst_s), "team": team, "priority": priority,
            "models": model or None}
    reply = _call(gateway, token, "PUT", f"/admin/keys/{key_id}" + ("?rotate=true" if rotate else ""), body)
    verb = "created" if reply.get("created") else "updated"
    out.print(f"key {key_id} {verb}")
    if secret := reply.get("secret"):
        out.print(f"secret (shown once, keep it now): {secret}", highlight=False, soft_wrap=True)


@keys_app.command("list")
def keys_list(json_out: Annotated[bool, typer.Option("--json")] = False,
              gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Every key with its limits (never a secret)."""
    reply = _call(gateway, token, "GET", "/admin/keys")
    if json_out:
        out.print_json(json.dumps(reply))
        return
    table = Table("Key", "Team", "RPM", "TPM", "Budget", "Priority", "Models", "Source")
    for k in reply["data"]:
        budget = f"{k['budget_tokens']}/{k['budget_period']}" if k["budget_tokens"] else "-"
        table.add_row(k["id"], k["team"] or "-", _fmt(k["rpm"]), _fmt(k["tpm"]), budget, k["priority"],
                      ", ".join(k["models"]) if k["models"] else "all", k["source"])
    for key_id in reply.get("static", []):
        table.add_row(key_id, "-", "-", "-", "-", "default", "all", "static")
    out.print(table)


@keys_app.command("rm")
def keys_rm(key_id: str, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Delete a key (every replica refuses it within a second)."""
    _call(gateway, token, "DELETE", f"/admin/keys/{key_id}")
    out.print(f"key {key_id} deleted")


@teams_app.command("set")
def teams_set(team_id: str, rpm: Rpm = 0, tpm: Tpm = 0, budget: Budget = 0, period: Period = "day",
              burst_s: Burst = 60.0, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    """Create (or replace) a team's limits."""
    reply = _call(gateway, token, "PUT", f"/admin/teams/{team_id}", _limits(rpm, tpm, budget, period, burst_s))
    out.print(f"team {team_id} {'created' if reply.get('created') else 'updated'}")


@teams_app.command("list")
def teams_list(gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    reply = _call(gateway, token, "GET", "/admin/teams")
    table = Table("Team", "RPM", "TPM", "Budget", "Keys")
    for t in reply["data"]:
        budget = f"{t['budget_tokens']}/{t['budget_period']}" if t["budget_tokens"] else "-"
        table.add_row(t["id"], _fmt(t["rpm"]), _fmt(t["tpm"]), budget, ", ".join(t["keys"]) or "-")
    out.print(table)


@teams_app.command("rm")
def teams_rm(team_id: str, gateway: Gateway = DEFAULT_URL, token: Token = "") -> None:
    _call(gateway, token, "DELETE", f"/admin/teams/{team_id}")
    out.print(f"team {team_id} deleted")


def usage(
    key: Annotated[str, typer.Option(help="Only this key id.")] = "",
    model: Annotated[str, typer.Option(help="Only this model.")] = "",
    day: Annotated[str, typer.Option(help="The last day (YYYY-MM-DD, UTC; default today).")] = "",
    days: Annotated[int, typer.Option(help="How many days back from --day.")] = 1,
    json_out: Annotated[bool, typer.Option("--json")] = False,
    gateway: Gateway = DEFAULT_URL, token: Token = "",
) -> None:
    """Usage per key, model and UTC day: requests, input and output tokens, errors, rate-limited."""
    query = {k: v for k, v in {"key": key, "model": model, "day": day, "days": str(days)}.items() if v}
    reply = _call(gateway, token, "GET", "/admin/usage?" + urlencode(query))
    if json_out:
        out.print_json(json.dumps(reply))
        return
    table = Table("Day", "Key", "Model", "Requests", "Input tokens", "Output tokens", "Errors", "Rate-limited")
    for r in reply["data"]:
        table.add_row(r["day"], r["key"], r["model"], *(str(r[c]) for c in (
            "requests", "input_tokens", "output_tokens", "errors", "rate_limited")))
    t = reply["totals"]
    table.add_row("total", "", "", *(str(t[c]) for c in (
        "requests", "input_tokens", "output_tokens", "errors", "rate_limited")), style="bold")
    out.print(table)
