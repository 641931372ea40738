"""Engines, one module each. A module named after the engine exports `ENGINE`, its class.

Adding an engine is adding one file here: `get_engine("name")` imports
`workers.engines.name` and instantiates its `ENGINE`.
"""

from __future__ import annotations

import importlib
import pkgutil

from workers.engines.base import AdapterError, Engine, EngineSpec


def get_engine(name: str) -> Engine:
    if not name.isidentifier() or name in ("base",):
        raise ValueError(f"unknown engine {name!r}")
    try:
        module = importlib.import_module(f"workers.engines.{name}")
    except ModuleNotFoundError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(known_engines())}") from None
    engine_cls = getattr(module, "ENGINE", None)
    if engine_cls is None:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(known_engines())}")
    return engine_cls()  # type: ignore[no-any-return]


def known_engines() -> list[str]:
    names = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"workers.engines.{info.name}")
        if getattr(module, "ENGINE", None) is not None:
            names.append(info.name)
    return sorted(names)


__all__ = ["AdapterError", "Engine", "EngineSpec", "get_engine", "known_engines"]
