"""What the policies that take no `routing` settings share (those settings tune the fleet policy only).

Kept out of base.py: base.py is compiled with mypyc (scripts/compile.py), and interpreted
classes cannot inherit from a compiled one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self


class Untuned:
    """A policy built the same whatever the `routing` settings say."""

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Self:
        return cls()
