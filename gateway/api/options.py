"""OPTIONS on a path that several handlers share: `Allow` lists every method of the path.

Litestar 2 builds a path's automatic OPTIONS handler with its first handler, and a later
handler on the same path joins the route without it learning the new method (litestar
issue #4169, fixed in Litestar 3): `OPTIONS /admin/keys/x` said `Allow: OPTIONS, PUT`
while DELETE is served there too. An explicit OPTIONS handler, registered ahead of the
path's handlers, keeps Litestar from making its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from litestar import Response, route
from litestar.enums import HttpMethod
from litestar.handlers import HTTPRouteHandler


def with_options(handlers: Sequence[Any]) -> list[Any]:
    """`handlers`, after an OPTIONS handler for each path more than one of them serve."""
    methods: dict[str, set[str]] = {}
    count: dict[str, int] = {}
    for handler in handlers:
        if isinstance(handler, HTTPRouteHandler):
            for path in handler.paths:
                methods.setdefault(path, set()).update(handler.http_methods)
                count[path] = count.get(path, 0) + 1
    return [*(_options(path, methods[path]) for path in methods if count[path] > 1), *handlers]


def _options(path: str, methods: set[str]) -> HTTPRouteHandler:
    allow = ", ".join(sorted({*methods, "OPTIONS"}))

    async def options() -> Response[None]:
        return Response(content=None, status_code=204, headers={"allow": allow})

    return route(path, http_method=[HttpMethod.OPTIONS], status_code=204, include_in_schema=False,
                 name=f"options:{path}")(options)
