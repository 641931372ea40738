"""A one-line progress bar on a terminal; a line every few seconds in a log."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, runs: int, stream: TextIO | None = None, every_s: float = 5.0) -> None:
        self.runs, self.stream, self.every_s = runs, stream or sys.stderr, every_s
        self.tty = self.stream.isatty()
        self.index = 0
        self.label = ""
        self.started = time.monotonic()
        self._last = 0.0

    def start_run(self, label: str, total: int = 0) -> None:
        self.index += 1
        self.label = label
        self.update(0, 0, total, force=True)

    def update(self, sent: int, done: int, total: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < (0.2 if self.tty else self.every_s):
            return
        self._last = now
        frac = ((self.index - 1) + (done / total if total else 0.0)) / max(self.runs, 1)
        bar = "#" * int(frac * 24)
        text = (f"[{bar:<24}] run {self.index}/{self.runs} {self.label}: "
                f"sent {sent}/{total} done {done}  {now - self.started:.0f}s")  # fmt: skip
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, message: str) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
        self.stream.write(message + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
