"""What every `fleetgate` command shares: the consoles and the gateway/token options."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

DEFAULT_URL = "http://127.0.0.1:8000"
out = Console()
err = Console(stderr=True)

Gateway = Annotated[str, typer.Option(
    "--gateway", "-g", envvar="FLEETGATE_URL", help="Gateway base URL.", show_default=True,
)]
Token = Annotated[str, typer.Option(
    "--token", envvar="FLEETGATE_ADMIN_TOKEN", help="Admin token (prefer the environment variable).",
    show_default=False,
)]
