"""structlog set-up shared by the gateway, the agents and the simulator.

Events have stable dotted names and key-value fields. JSON when stderr is not a
terminal, coloured key-value lines when it is. Standard-library loggers (uvicorn,
httpx, aiohttp) are routed through the same renderer and kept at WARNING so that
no per-request line is written by a library.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import json as jsonlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

_NOISY = ("httpx", "httpcore", "aiohttp.access", "uvicorn.access", "litestar", "asyncio")


_encoder = msgspec.json.Encoder()


def _dumps(obj: object, **_: object) -> str:
    # msgspec encodes an event in a fraction of the stdlib's time; str() for what it cannot.
    try:
        return _encoder.encode(obj).decode()
    except TypeError:
        return jsonlib.dumps(obj, default=str)


def _render_bytes(_logger: object, _name: str, event: structlog.types.EventDict) -> bytes:
    """The JSON line as bytes, for structlog's BytesLogger (no str round trip)."""
    try:
        return _encoder.encode(event)
    except TypeError:
        return jsonlib.dumps(event, default=str).encode()


class _Stamper:
    """structlog's TimeStamper(fmt="iso", utc=True), same text, a fraction of its cost: the
    date and time of day are formatted once a second, only the microseconds per line."""

    __slots__ = ("_prefix", "_sec")

    def __init__(self) -> None:
        self._sec = -1
        self._prefix = ""

    def __call__(self, _logger: object, _name: str, event: structlog.types.EventDict) -> structlog.types.EventDict:
        now = time.time()
        sec = int(now)
        if sec != self._sec:
            self._sec, self._prefix = sec, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        event["timestamp"] = f"{self._prefix}.{int((now - sec) * 1e6):06d}Z"
        return event


class LoopFlushedLogger:
    """structlog's BytesLogger without a write(2) per line: a line logged on an event loop waits
    in a list until the loop's current iteration is over (a `call_soon`), and the lines of
    requests that finish together go out in one write (stderr is often unbuffered:
    PYTHONUNBUFFERED, as containers set it). Outside a running loop (start-up, threads) a
    line is written at once. A line waits no longer than the loop iteration that logged it;
    only a process killed in that iteration loses it."""

    __slots__ = ("__weakref__", "_file", "_lines", "_pending", "_thread")

    def __init__(self, file: object) -> None:
        self._file = file
        self._lines: list[bytes] = []
        self._pending: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on
        self._thread = 0  # the thread that loop runs in
        # A child forked inside a loop's callback is not in that loop: it looks again.
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))

    def msg(self, message: bytes) -> None:
        pending = self._pending
        # The flush scheduled on a loop that still runs in this thread takes this line too (no
        # loop lookup: under Python 3.11 it costs a getpid(2) call per line).
        if pending is not None and self._thread == threading.get_ident() and pending.is_running():
            self._lines.append(message)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._file.write(message + b"\n")  # type: ignore[attr-defined]
            self._file.flush()  # type: ignore[attr-defined]
            return
        self._lines.append(message)
        if self._pending is not loop:  # (a loop that stopped before flushing does not hold lines back)
            self._pending = loop
            self._thread = threading.get_ident()
            loop.call_soon(self.flush)

    def flush(self) -> None:
        self._pending = None
        lines = self._lines
        n = len(lines)  # a line another thread's loop adds meanwhile stays for its own flush
        if n:
            data = b"\n".join(lines[:n]) + b"\n"
            del lines[:n]
            self._file.write(data)  # type: ignore[attr-defined]
            self._file.flush()  # type: ignore[attr-defined]

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def _forked(ref: weakref.ref[LoopFlushedLogger]) -> None:
    logger = ref()
    if logger is not None:
        logger._pending = None


def _json_wrapper(min_level: int, chain: list[Any], stamper: _Stamper) -> type[Any]:
    """structlog's filtering bound logger whose `info` runs `chain` (the JSON chain below) inline:
    the same line, without the generic path's dispatch (one event per request is at info).
    Any other level, positional arguments, exc_info, or a chain configured since (structlog's
    capture_logs in a test) takes structlog's own path."""
    base: type[Any] = structlog.make_filtering_bound_logger(min_level)
    if min_level > logging.INFO:
        return base
    merge = structlog.contextvars.merge_contextvars

    class JSONBoundLogger(base):  # type: ignore[misc, valid-type]
        def info(self, event: str, *args: Any, **kw: Any) -> Any:
            if args or "exc_info" in kw or self._processors is not chain:
                return base.info(self, event, *args, **kw)
            event_dict = self._context.copy()
            event_dict.update(kw)
            event_dict["event"] = event
            merge(None, "info", event_dict)
            event_dict["level"] = "info"
            stamper(None, "info", event_dict)
            return self._logger.msg(_render_bytes(None, "info", event_dict))

    return JSONBoundLogger


def _factory(logger: LoopFlushedLogger) -> Callable[..., LoopFlushedLogger]:
    return lambda *_: logger


def configure_logging(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stderr.isatty()
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(serializer=_dumps) if json else structlog.dev.ConsoleRenderer()
    )
    out = getattr(sys.stderr, "buffer", None)
    if json and out is not None:
        # The request path logs a line per request: bytes straight to stderr's buffer, a loop
        # iteration's lines in one write, and a cheaper clock stamp (the lines read the same).
        lines = LoopFlushedLogger(out)
        atexit.register(lines.flush)  # lines of a loop that stopped before its flush
        stamper = _Stamper()
        chain: list[Any] = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                            stamper, structlog.processors.format_exc_info, _render_bytes]
        structlog.configure(
            processors=chain,
            wrapper_class=_json_wrapper(numeric, chain, stamper),
            logger_factory=_factory(lines),
            cache_logger_on_first_use=True,
        )
    else:
        structlog.configure(
            processors=[*shared, structlog.processors.format_exc_info, renderer],
            wrapper_class=structlog.make_filtering_bound_logger(numeric),
            logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
            cache_logger_on_first_use=True,
        )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for name in _NOISY:
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
