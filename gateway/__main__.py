"""`python -m gateway --port 8000 --redis-url redis://...`: run the gateway under uvicorn."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

import structlog
import uvicorn
import yaml

from fleetgate.logs import configure_logging
from gateway.app import create_asgi
from gateway.front.fastpath import FastPath
from gateway.front.front_limits import FrontGuard, raise_fd_limit
from gateway.front.multiproc import Supervisor, reuse_port_socket
from gateway.front.server import GatewayHttpProtocol
from gateway.settings_check import SettingsError, load_checked

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "gateway.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__)
    parser.add_argument("--config", default=os.environ.get("FLEETGATE_CONFIG", str(DEFAULT_CONFIG)))
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--redis-url")
    parser.add_argument("--redis-prefix")
    parser.add_argument("--policy")
    parser.add_argument("--admin-token", help="prefer the FLEETGATE_ADMIN_TOKEN variable")
    parser.add_argument("--log-level")
    parser.add_argument("--workers", type=int, default=int(os.environ.get("FLEETGATE_WORKERS", "1")),
                        help="gateway processes on the one port (SO_REUSEPORT), one per core; "
                             "they share state through Redis like replicas (default 1)")
    parser.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any setting of config/gateway.yaml (YAML value); repeatable")
    return parser


def _overrides(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, object]:
    """The settings given on the command line: its options, then each `--set KEY=VALUE`."""
    overrides = {
        k: v for k, v in vars(args).items()
        if k not in ("config", "set", "workers", "reuse_port") and v is not None
    }
    for pair in args.set:
        key, sep, value = pair.partition("=")
        if not sep:
            parser.error(f"--set needs KEY=VALUE, got {pair!r}")
        try:
            overrides[key.strip().replace("-", "_")] = yaml.safe_load(value)
        except yaml.YAMLError:
            parser.error(f"--set {key.strip()}: the value is not valid YAML: {value!r}")
    return overrides


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    overrides = _overrides(parser, args)
    if args.config != str(DEFAULT_CONFIG) and not Path(args.config).exists():
        parser.error(f"--config {args.config}: no such file")
    try:
        settings = load_checked(args.config, overrides)
    except SettingsError as exc:
        parser.print_usage(sys.stderr)
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    configure_logging(settings.log_level, settings.log_json)
    if args.workers < 1:
        parser.error("--workers needs 1 or more")
    if args.workers > 1:
        if not settings.port:
            parser.error("--workers needs a fixed --port")
        sys.exit(Supervisor(sys.argv[1:] if argv is None else argv, args.workers, settings.host,
                            settings.port).run())
    # SIGHUP reads the config file again to seed keys and teams (gateway/tenancy.py).
    # Client connections are bounded by the file descriptors the process may open: as many as
    # its hard limit allows (gateway/front/front_limits.py keeps the limits on them).
    front = FrontGuard.from_settings(settings, raise_fd_limit())
    asgi = create_asgi(settings, lambda: load_checked(args.config, overrides), front)
    config = uvicorn.Config(
        asgi,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=30,
        timeout_keep_alive=settings.idle_timeout_s,  # type: ignore[arg-type]  # an int in its hints; a float works
        server_header=False,
        http=functools.partial(GatewayHttpProtocol, fast=asgi if isinstance(asgi, FastPath) else None,  # type: ignore[arg-type]
                               guard=front),
    )
    server = uvicorn.Server(config)
    if args.reuse_port:  # one of --workers N: every line it logs says which process wrote it
        structlog.contextvars.bind_contextvars(gateway_pid=os.getpid())
        server.run(sockets=[reuse_port_socket(settings.host, settings.port)])
    else:
        server.run()
    if not server.started:
        sys.exit(3)  # uvicorn's code for a failed start-up (the lifespan raised, the port is taken)


if __name__ == "__main__":
    main()
