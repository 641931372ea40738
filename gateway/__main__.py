"""`python -m gateway --port 8000 --redis-url redis://...`: run the gateway under uvicorn."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec
import uvicorn
import yaml

from fleetgate.logs import configure_logging
from gateway.app import create_asgi
from gateway.settings import load_settings

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "gateway.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--config", default=os.environ.get("FLEETGATE_CONFIG", str(DEFAULT_CONFIG)))
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--redis-url")
    parser.add_argument("--redis-prefix")
    parser.add_argument("--policy")
    parser.add_argument("--admin-token", help="prefer the FLEETGATE_ADMIN_TOKEN variable")
    parser.add_argument("--log-level")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any setting of config/gateway.yaml (YAML value); repeatable")
    args = parser.parse_args(argv)
    overrides = {
        k: v for k, v in vars(args).items() if k not in ("config", "set") and v is not None
    }
    for pair in args.set:
        key, sep, value = pair.partition("=")
        if not sep:
            parser.error(f"--set needs KEY=VALUE, got {pair!r}")
        overrides[key.strip().replace("-", "_")] = yaml.safe_load(value)
    try:
        settings = load_settings(args.config, overrides)
    except msgspec.ValidationError as exc:
        parser.error(f"bad setting: {exc}")
    configure_logging(settings.log_level, settings.log_json)
    uvicorn.run(
        # SIGHUP reads the config file again to seed keys and teams (gateway/tenancy.py).
        create_asgi(settings, lambda: load_settings(args.config, overrides)),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=30,
        server_header=False,
    )


if __name__ == "__main__":
    main()
