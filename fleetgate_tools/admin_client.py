"""The gateway's admin API as every control-plane tool calls it (the `fleetgate` commands and
the autoscaler, fleetgate_tools/autoscale_loop.py): one client, one error (`CliError`, whose
message is the whole report), one way to fail a command."""

from __future__ import annotations

from typing import Any, NoReturn

import httpx
import typer

from fleetgate_tools.cli_options import err


class CliError(Exception):
    """A failure the operator can act on; its message is the whole report."""


def fail(message: str) -> NoReturn:
    """Print the operator's report in red and exit 1."""
    err.print(f"[bold red]fleetgate:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


class Admin:
    """The gateway's admin API; every transport or HTTP failure becomes one CliError. Its
    connections are kept between calls (a long-lived caller, the autoscaler); `close` them."""

    def __init__(self, url: str, token: str, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout
        self._http = httpx.Client(timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, method: str, path: str, body: Any = None) -> Any:
        if not self.token:
            raise CliError("no admin token: set FLEETGATE_ADMIN_TOKEN or pass --token.")
        resp = self._send(method, path, {"authorization": f"Bearer {self.token}"}, body)
        if resp.status_code == 401:
            raise CliError(
                f"the gateway at {self.url} refused the admin token: check --token / "
                "FLEETGATE_ADMIN_TOKEN (it must equal the gateway's FLEETGATE_ADMIN_TOKEN)."
            )
        if resp.status_code >= 500:
            raise CliError(self._server_trouble(method, path, resp))
        if resp.status_code >= 400:
            raise CliError(f"{method} {path}: {_error_message(resp)}")
        try:
            return resp.json()
        except ValueError:
            raise CliError(
                f"{self.url} answered {method} {path} with something other than JSON: "
                "is --gateway the fleetgate gateway?"
            ) from None

    def _send(self, method: str, path: str, headers: dict[str, str], body: Any = None) -> httpx.Response:
        url = self.url + path
        try:
            return self._http.request(method, url, headers=headers, json=body)
        except httpx.TimeoutException:
            raise CliError(
                f"the gateway at {url} did not answer within {self.timeout:g} s: is it overloaded "
                "or stuck? check its logs."
            ) from None
        except (httpx.TransportError, httpx.InvalidURL) as exc:
            reason = str(exc) or type(exc).__name__
            raise CliError(
                f"cannot reach the gateway at {url} ({reason}): is it running? check --gateway / "
                "FLEETGATE_URL."
            ) from None

    def _server_trouble(self, method: str, path: str, resp: httpx.Response) -> str:
        """A 5xx from an admin call: Redis is the usual cause, and /health says so."""
        try:
            health = self._send("GET", "/health", {}).json()
        except (CliError, ValueError):
            health = {}
        if health.get("status") == "degraded":
            return (
                f"the gateway at {self.url} cannot reach its Redis registry "
                f"({health.get('registry_error', 'unknown error')}): check that Redis runs and the "
                "gateway's --redis-url / FLEETGATE_REDIS_URL."
            )
        return f"{method} {path} failed on the gateway ({_error_message(resp)}): check the gateway's logs."


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}"


def call(gateway: str, token: str, method: str, path: str, body: Any = None) -> Any:
    """One admin call for a command: its JSON answer, or the command fails with the report."""
    try:
        with Admin(gateway, token) as admin:
            return admin.call(method, path, body)
    except CliError as exc:
        fail(str(exc))
