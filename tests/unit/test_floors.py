"""The house's floors hold: the kernel imports nothing above it, nothing but tests and scripts
imports the tools floor, and the gateway and the workers never import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What each package may import of the project's packages (besides itself).
ALLOWED = {
    "fleetgate": set(),
    "gateway": {"fleetgate"},
    "workers": {"fleetgate"},
    "fleetgate_tools": {"fleetgate", "gateway", "workers"},
}


def imported_packages(path: Path) -> set[str]:
    """The top-level names every import statement of the file names (lazy imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_package_imports_only_what_stands_below_it(package: str) -> None:
    """Every module of `package` imports, of the project, only itself and the floors below."""
    project = set(ALLOWED)
    wrong = {
        str(path.relative_to(ROOT)): sorted(found)
        for path in sorted((ROOT / package).rglob("*.py"))
        if (found := (imported_packages(path) & project) - ALLOWED[package] - {package})
    }
    assert wrong == {}


def test_the_floor_check_sees_an_import_that_runs_back_up(tmp_path: Path) -> None:
    """The check is not blind: a kernel module importing the gateway, even lazily, is caught."""
    module = tmp_path / "bad.py"
    module.write_text("import os\n\ndef f():\n    from gateway.routing import POLICIES\n    return POLICIES\n")
    assert imported_packages(module) & set(ALLOWED) == {"gateway"}
