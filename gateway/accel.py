"""The compiled request path: use it only while it matches the source.

`scripts/compile.py` (run by `make venv`) compiles the modules on the request path with
mypyc, in place: `gateway/front/fastpath.py` gets `gateway/front/fastpath.cpython-311-...so` beside
it, and Python imports the `.so` before the `.py`. It also writes `gateway/_accel.json`,
the SHA-256 of each source it compiled.

A compiled copy that no longer matches its source would run old code. So when the
package is imported, `guard` compares the sources with that manifest. If any differs, or
FLEETGATE_PURE=1 is set, a finder sends every module of the group to its `.py` (all of
them: compiled modules of one group call each other directly, so one stale module makes
the group stale) and a warning says how to rebuild. Without a manifest there is nothing
compiled and nothing to do. Pure Python and compiled code behave the same; the compiled
one costs less CPU per request (docs/benchmarks.md).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType

MANIFEST = "_accel.json"


class _SourceFirst(importlib.abc.MetaPathFinder):
    """Finds the listed modules' `.py` files, ahead of the compiled ones beside them."""

    def __init__(self, sources: Mapping[str, Path]) -> None:
        self.sources = dict(sources)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        if source is None:
            return None
        loader = importlib.machinery.SourceFileLoader(fullname, str(source))
        return importlib.util.spec_from_file_location(fullname, source, loader=loader)


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def _source(root: Path, module: str) -> Path:
    return root.joinpath(*module.split(".")[1:]).with_suffix(".py")


def guard(package: str, package_dir: str, environ: Mapping[str, str] = os.environ) -> str:
    """Check `package`'s compiled modules against their sources; returns the state:
    "pure" (nothing compiled), "compiled", "stale" or "disabled" (the last two run the
    sources)."""
    root = Path(package_dir)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        modules: dict[str, str] = manifest["modules"]
    except (OSError, ValueError, KeyError, TypeError):
        return "pure"
    stale = sorted(m for m, digest in modules.items() if _digest(_source(root, m)) != digest)
    disabled = environ.get("FLEETGATE_PURE", "") not in ("", "0")
    if not stale and not disabled:
        return "compiled"
    sys.meta_path.insert(0, _SourceFirst({m: _source(root, m) for m in modules if m.startswith(package + ".")}))
    if disabled:
        return "disabled"
    print(f"fleetgate: the compiled {', '.join(stale)} no longer match{'es' if len(stale) == 1 else ''} "
          "the source; running the source (pure Python). `make venv` or `python scripts/compile.py` "
          "compiles it again.", file=sys.stderr)
    return "stale"
