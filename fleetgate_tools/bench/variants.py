"""A gateway policy with routing options, spelled as one strategy name: `fleet+kv_events=false`.

The name is the policy, then `+key=value` pairs (YAML values) for the gateway's `routing:`
settings block (FleetOptions, gateway/routing/records.py). Each run of such a strategy starts
its gateway with the config's `routing:` block and these keys on top (`--set routing=...`: a
`--set` replaces the whole block, so the config's own knobs are carried along). The name is
the row's label in every table, so `fleet+kv_events=false` and `fleet+kv_events=true` sit side
by side on the identical workload.

A key the gateway does not know (FleetOptions has no such field, e.g. a knob another change
has yet to add) is left out with a warning and listed in the run's `routing_ignored`, instead
of failing the gateway's start: the run is then the plain policy, and the report says so.

    python -c "import sys; from fleetgate_tools.bench.variants import main; sys.exit(main())" [--check] NAME [CONFIG]
prints the gateway's policy, then its extra arguments, one per line (scripts/gpu_bench_*.sh);
the ignored keys go to stderr. With --check it prints nothing and exits 1, saying why, when
the gateway would refuse those settings (checked as `python -m gateway` checks them at start),
so that a GPU run finds out before it starts any engine.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "config" / "gateway.yaml"


class Variant(NamedTuple):
    name: str  # as asked, the row's label
    policy: str
    routing: dict[str, Any]


def parse(name: str) -> Variant:
    """`fleet+kv_events=false+balance=0.3` -> Variant(name, "fleet", {kv_events: False, balance: 0.3})."""
    policy, *pairs = name.split("+")
    routing: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"strategy {name!r}: {pair!r} is not key=value")
        routing[key.strip()] = yaml.safe_load(value)
    return Variant(name, policy, routing)


def known_knobs() -> frozenset[str]:
    """The routing options this gateway reads (FleetOptions' fields)."""
    from gateway.routing.records import FleetOptions

    return frozenset(FleetOptions.__struct_fields__)


def config_routing(config: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The `routing:` block of the gateway's config file (FLEETGATE_CONFIG, else config/gateway.yaml)."""
    path = Path(config or os.environ.get("FLEETGATE_CONFIG") or DEFAULT_CONFIG)
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    section = data.get("gateway", data) if isinstance(data, dict) else {}
    routing = section.get("routing") if isinstance(section, dict) else None
    return dict(routing) if isinstance(routing, Mapping) else {}


class GatewayArgs(NamedTuple):
    policy: str
    args: list[str]  # beyond --policy
    ignored: list[str]  # routing keys this gateway does not know


def gateway_args(name: str, config: str | os.PathLike[str] | None = None,
                 knobs: frozenset[str] | None = None) -> GatewayArgs:  # fmt: skip
    """How to start a gateway for the strategy `name` (a policy, or a policy with options)."""
    v = parse(name)
    if not v.routing:
        return GatewayArgs(v.policy, [], [])
    known = known_knobs() if knobs is None else knobs
    ignored = sorted(k for k in v.routing if k not in known)
    merged = config_routing(config) | {k: val for k, val in v.routing.items() if k in known}
    args = ["--set", "routing=" + json.dumps(merged)] if len(ignored) < len(v.routing) else []
    return GatewayArgs(v.policy, args, ignored)


def refusal(name: str, config: str | os.PathLike[str] | None = None) -> str:
    """Why a gateway started for the strategy `name` would refuse its settings ("" if it would not)."""
    from gateway.settings_check import SettingsError, load_checked

    got = gateway_args(name, config)
    overrides: dict[str, Any] = {"policy": got.policy}
    if got.args:
        overrides["routing"] = json.loads(got.args[1].split("=", 1)[1])
    path = Path(config or os.environ.get("FLEETGATE_CONFIG") or DEFAULT_CONFIG)
    try:
        load_checked(path, overrides)
    except SettingsError as exc:
        return str(exc)
    return ""


def label_file(name: str) -> str:
    """A strategy name safe in a file name (`fleet+kv_events=false` stays as it is; anything
    but letters, digits and `_+=.-` becomes `_`)."""
    return "".join(c if c.isalnum() or c in "_+=.-" else "_" for c in name)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = bool(args) and args[0] == "--check"
    args = args[1:] if check else args
    if not 1 <= len(args) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    if check:
        why = refusal(args[0], args[1] if len(args) > 1 else None)
        if why:
            print(f"variants: a gateway for {args[0]} would not start: {why}", file=sys.stderr)
        return 1 if why else 0
    got = gateway_args(args[0], args[1] if len(args) > 1 else None)
    for key in got.ignored:
        print(f"variants: routing option {key!r} is unknown to this gateway: {args[0]} runs without it",
              file=sys.stderr)  # fmt: skip
    print("\n".join([got.policy, *got.args]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
