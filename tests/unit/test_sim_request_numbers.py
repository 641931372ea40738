"""The simulator reads a request's integers as vLLM's pydantic models do (lax mode): a whole
float is the integer, a fractional one or a boolean is refused with vLLM's 400."""

from __future__ import annotations

from typing import Any

import pytest

from workers.simulator.flavors import SimError
from workers.simulator.requests import opt_int


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), (2, 2), (2.0, 2), (64.0, 64), (1, 1)],
)
def test_a_whole_number_is_taken(value: Any, expected: int | None) -> None:
    assert opt_int({"max_tokens": value}, "max_tokens", 1) == expected


@pytest.mark.parametrize("value", [2.5, True, "2", [2], 0, 0.0, -3.0])
def test_anything_else_is_refused(value: Any) -> None:
    with pytest.raises(SimError) as info:
        opt_int({"max_tokens": value}, "max_tokens", 1)
    assert (info.value.status, info.value.param) == (400, "max_tokens")
