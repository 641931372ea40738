"""The order `make test` hands modules to its workers (tests/conftest.py `module_order`)."""

from __future__ import annotations

import pytest

from tests.conftest import REAL_ENGINES_SCOPE, module_order


@pytest.mark.parametrize(("scopes", "seconds", "expected"), [
    # longest first
    (["a", "b", "c"], {"a": 1.0, "b": 30.0, "c": 5.0}, ["b", "c", "a"]),
    # the real engines' unit before any, whatever the table says
    (["a", REAL_ENGINES_SCOPE, "b"], {"a": 90.0, "b": 1.0, REAL_ENGINES_SCOPE: 0.0}, [REAL_ENGINES_SCOPE, "a", "b"]),
    # a module the table does not know counts as the median of those it knows
    (["new", "a", "b", "c"], {"a": 1.0, "b": 10.0, "c": 20.0}, ["c", "b", "new", "a"]),
    # equal costs keep a stable order by name; no table: by name
    (["y", "x"], {"x": 2.0, "y": 2.0}, ["x", "y"]),
    (["y", "x"], {}, ["x", "y"]),
])
def test_modules_go_out_longest_first(scopes: list[str], seconds: dict[str, float], expected: list[str]) -> None:
    assert module_order(scopes, seconds) == expected
