"""Settings that fail loudly: every mistake is one line naming the key, the value and what
is allowed, where it came from, before anything starts.

msgspec already refuses an unknown key or a wrong type, but says `$.aliases[...]` without
the key and lists nothing; the routing knobs, the policy's name, the log level and the
aliases are checked here too (a routing knob was silently ignored by every policy but
`fleet`, and an unknown policy ended in a traceback). `python -m gateway` prints the
message and exits with status 2, as for a bad flag.
"""

from __future__ import annotations

import difflib
import logging
import os
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import yaml

from gateway.front.front_limits import FrontLimits
from gateway.front.front_limits import problems as front_problems
from gateway.models.aliases import problems
from gateway.routing import POLICIES, FleetOptions
from gateway.settings import GatewaySettings, gather

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


class SettingsError(ValueError):
    """A setting that cannot be used; the message is one line, meant for the operator."""


def load_checked(
    config_path: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> GatewaySettings:
    """`load_settings`, with every problem raised as one SettingsError."""
    where = f" in {config_path}" if config_path else ""
    try:
        data, sources = gather(config_path, overrides, environ)
    except yaml.YAMLError as exc:
        raise SettingsError(f"the config file{where} is not valid YAML: {_one_line(exc)}") from None
    except msgspec.ValidationError:
        raise SettingsError(f"the config file{where} must hold a mapping of settings (under `gateway:`)") from None
    try:
        settings = msgspec.convert(data, GatewaySettings, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(_explain(exc, data, sources)) from None
    if found := check(settings):
        raise SettingsError("; ".join(found))
    return settings


def check(settings: GatewaySettings) -> list[str]:
    """What is wrong with settings that have the right shape, one line each."""
    out: list[str] = []
    if settings.policy not in POLICIES:
        out.append(_unknown("routing policy", settings.policy, POLICIES, " (`policy`)"))
    knobs = FleetOptions.__struct_fields__
    for key in settings.routing:
        if key not in knobs:
            out.append(_unknown("routing knob", f"routing.{key}", knobs, " (gateway/routing/fleet.py)", key))
    try:
        msgspec.convert(dict(settings.routing), FleetOptions)
    except msgspec.ValidationError as exc:
        if "unknown field" not in str(exc):
            out.append(f"bad `routing` knob: {_message(exc)}")
    if not isinstance(logging.getLevelName(settings.log_level.upper()), int):  # WARN is one too
        out.append(_unknown("`log_level`", settings.log_level, LOG_LEVELS))
    out.extend(problems(settings.aliases, settings.fallbacks))
    out.extend(front_problems(FrontLimits.from_settings(settings)))
    return out


def _unknown(what: str, value: str, known: Iterable[str], origin: str = "", bare: str | None = None) -> str:
    names = sorted(known)
    close = difflib.get_close_matches(value if bare is None else bare, names, n=1)
    hint = f"; did you mean `{close[0]}`?" if close else ";"
    return f"unknown {what} `{value}`{origin}{hint} known: {', '.join(names)}"


def _explain(exc: msgspec.ValidationError, data: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    """msgspec's message with the key spelled out (`aliases.chat[0]`) and the allowed fields."""
    text = str(exc)
    path = text.rsplit(" - at `$", 1)[1].rstrip("`") if " - at `$" in text else ""
    top = path.lstrip(".").split("[", 1)[0].split(".", 1)[0]
    if not top:  # an unknown top-level key
        field = text.split("unknown field `", 1)[1].split("`", 1)[0] if "unknown field `" in text else ""
        origin = f" (from {sources[field]})" if field in sources else ""
        return _unknown("setting", field, GatewaySettings.__struct_fields__, origin) if field else text
    origin = f" (from {sources[top]})" if top in sources else ""
    hint = typing.get_type_hints(GatewaySettings)[top]
    if path.startswith(f".{top}[...]") and isinstance(data.get(top), dict):
        value_type = typing.get_args(hint)[1]
        for key, value in data[top].items():  # which entry msgspec meant by `[...]`
            try:
                msgspec.convert(value, value_type, strict=False)
            except msgspec.ValidationError as inner:
                path = f".{top}.{key}{path[len(top) + 6:]}"
                return _with_fields(f"bad setting `{path[1:]}`{origin}: {_message(inner)}", inner, value_type)
    value = f" ({data[top]!r})" if path == f".{top}" and top in data else ""
    return _with_fields(f"bad setting `{path[1:]}`{origin}: {_message(exc)}{value}", exc, hint)


def _with_fields(line: str, exc: msgspec.ValidationError, hint: Any) -> str:
    """The line, plus the fields of the struct an unknown or missing field belongs to."""
    struct = _struct_in(hint)
    if struct is None or not ("unknown field" in str(exc) or "missing required field" in str(exc)):
        return line
    return f"{line} (fields: {', '.join(struct.__struct_fields__)})"


def _struct_in(hint: Any) -> type[msgspec.Struct] | None:
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return hint
    for arg in typing.get_args(hint):
        if (found := _struct_in(arg)) is not None:
            return found
    return None


def _message(exc: Exception) -> str:
    text = str(exc)
    return text.rsplit(" - at `$", 1)[0][:1].lower() + text.rsplit(" - at `$", 1)[0][1:]


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


__all__ = ["SettingsError", "check", "load_checked"]
