"""gateway/accel.py: compiled modules run only while they match their sources.

The fake compiled modules here are files that are not shared libraries: importing one
raises ImportError, so an import that succeeds proves the guard sent it to the source,
and one that fails proves Python went to the `.so` as it does for a real compiled one.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import subprocess
import sys
from pathlib import Path

import pytest

import gateway
from gateway import accel

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
ROUTE_DECORATORS = {"get", "post", "put", "patch", "delete", "route"}


def _package(tmp_path: Path, name: str, digest_of: dict[str, str] | None = None) -> Path:
    root = tmp_path / name
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    sources = {f"{name}.fast": root / "fast.py", f"{name}.sub.deep": root / "sub" / "deep.py"}
    for module, path in sources.items():
        path.write_text(f"WHERE = 'source of {module}'\n")
        path.with_name(path.stem + SUFFIX).write_bytes(b"not a shared library")
    digests = {m: hashlib.sha256(p.read_bytes()).hexdigest() for m, p in sources.items()}
    digests.update(digest_of or {})
    (root / accel.MANIFEST).write_text(json.dumps({"modules": digests}))
    return root


@pytest.fixture
def clean_imports(tmp_path: Path):  # type: ignore[no-untyped-def]
    finders, path = list(sys.meta_path), list(sys.path)
    sys.path.insert(0, str(tmp_path))
    yield
    sys.meta_path[:] = finders
    sys.path[:] = path
    for name in [n for n in sys.modules if n.startswith("accelpkg")]:
        del sys.modules[name]


def test_matching_sources_leave_the_compiled_modules_in_charge(tmp_path: Path, clean_imports: None) -> None:
    root = _package(tmp_path, "accelpkg1")
    assert accel.guard("accelpkg1", str(root), environ={}) == "compiled"
    with pytest.raises(ImportError):
        __import__("accelpkg1.fast")


def test_one_changed_source_sends_the_whole_group_to_the_sources(tmp_path: Path, clean_imports: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    root = _package(tmp_path, "accelpkg2", digest_of={"accelpkg2.fast": "0" * 64})
    assert accel.guard("accelpkg2", str(root), environ={}) == "stale"
    assert "accelpkg2.fast" in capsys.readouterr().err
    fast = __import__("accelpkg2.fast", fromlist=["WHERE"])
    deep = __import__("accelpkg2.sub.deep", fromlist=["WHERE"])
    assert (fast.WHERE, deep.WHERE) == ("source of accelpkg2.fast", "source of accelpkg2.sub.deep")


def test_fleetgate_pure_runs_the_sources(tmp_path: Path, clean_imports: None) -> None:
    root = _package(tmp_path, "accelpkg3")
    assert accel.guard("accelpkg3", str(root), environ={"FLEETGATE_PURE": "1"}) == "disabled"
    assert __import__("accelpkg3.sub.deep", fromlist=["WHERE"]).WHERE == "source of accelpkg3.sub.deep"


def test_no_manifest_means_pure(tmp_path: Path) -> None:
    assert accel.guard("nothing", str(tmp_path), environ={}) == "pure"


def test_this_checkout_imports_what_the_guard_says() -> None:
    """The real package, in a fresh interpreter: compiled modules come from `.so` files
    exactly when the guard says "compiled", and FLEETGATE_PURE=1 always gives sources."""
    code = "import gateway, gateway.front.fastpath as f, gateway.routing.homes as h; print(gateway.ACCEL, f.__file__, h.__file__)"
    for env, pure in (({}, False), ({"FLEETGATE_PURE": "1"}, True)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**_env(), **env}, cwd=Path(gateway.__file__).parent.parent).stdout.split()
        state, files = out[0], out[1:]
        if pure or state != "compiled":
            assert state in ("pure", "disabled", "stale") and all(f.endswith(".py") for f in files), out
        else:
            assert all(f.endswith(SUFFIX) for f in files), out


def _env() -> dict[str, str]:
    import os
    return {k: v for k, v in os.environ.items() if k != "FLEETGATE_PURE"}


def _compile_script():  # type: ignore[no-untyped-def]
    import importlib.util
    path = Path(gateway.__file__).parent.parent / "scripts" / "compile.py"
    spec = importlib.util.spec_from_file_location("fleetgate_compile_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_compiled_module_defines_a_msgspec_struct_or_a_route() -> None:
    """mypyc keeps a compiled class's annotations only as plain types (`list` for
    `list[Message]`), so a Struct defined in a compiled module would decode with less
    validation than its source says (decoded shapes live in gateway/wire.py and
    gateway/routing/records.py); and Litestar cannot read a compiled handler's signature."""
    import ast
    script = _compile_script()
    root = Path(gateway.__file__).parent.parent
    offenders = []
    for module in script.MODULES:
        for node in ast.walk(ast.parse((root / module).read_text())):
            if isinstance(node, ast.ClassDef) and any("Struct" in ast.unparse(b) for b in node.bases):
                offenders.append(f"{module}: {node.name}")
            if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and ast.unparse(d.func) in ROUTE_DECORATORS for d in node.decorator_list):
                offenders.append(f"{module}: {node.name}")
    assert script.MODULES and not offenders
