"""Charts without a plotting library: an RGB canvas, a 3x5 pixel font, a PNG encoder.

No matplotlib or Pillow is needed (neither is a dependency): `zlib` and `struct` write the
PNG, and the charts are plain lines, bars and block letters. One row per workload: the
TTFT CDF of every policy on the left, output tokens/s per policy on the right.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RGB = tuple[int, int, int]

_FONT_ROWS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", "A": "010101111101101", "B": "110101110101110",
    "C": "011100100100011", "D": "110101101101110", "E": "111100110100111",
    "F": "111100110100100", "G": "011100101101011", "H": "101101111101101",
    "I": "111010010010111", "J": "001001001101010", "K": "101101110101101",
    "L": "100100100100111", "M": "101111111101101", "N": "110101101101101",
    "O": "010101101101010", "P": "110101110100100", "Q": "010101101110011",
    "R": "110101110101101", "S": "011100010001110", "T": "111010010010010",
    "U": "101101101101111", "V": "101101101101010", "W": "101101111111101",
    "X": "101101010101101", "Y": "101101010010010", "Z": "111001010100111",
    ".": "000000000000010", "-": "000000111000000", "_": "000000000000111",
    "%": "101001010100101", ":": "000010000010000", "/": "001001010100100",
    "(": "010100100100010", ")": "010001001001010", ",": "000000000010100",
    "=": "000111000111000", "+": "000010111010000", " ": "000000000000000",
}  # fmt: skip

PALETTE: tuple[RGB, ...] = (
    (31, 119, 180), (214, 39, 40), (44, 160, 44), (255, 127, 14),
    (148, 103, 189), (140, 86, 75), (227, 119, 194), (23, 190, 207),
)  # fmt: skip
WHITE: RGB = (255, 255, 255)
BLACK: RGB = (0, 0, 0)
GREY: RGB = (200, 200, 200)


class Canvas:
    def __init__(self, width: int, height: int, background: RGB = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: RGB) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: RGB) -> None:
        for y in range(max(0, min(y0, y1)), min(self.height, max(y0, y1) + 1)):
            for x in range(max(0, min(x0, x1)), min(self.width, max(x0, x1) + 1)):
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: RGB, width: int = 1) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for k in range(width):
                self.set(x0, y0 + k, color)
            if x0 == x1 and y0 == y1:
                break
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: RGB = BLACK, scale: int = 2) -> int:
        """Block letters (upper case); returns the x after the text."""
        for ch in text.upper():
            rows = _FONT_ROWS.get(ch, _FONT_ROWS[" "])
            for i, bit in enumerate(rows):
                if bit == "1":
                    cx, cy = x + (i % 3) * scale, y + (i // 3) * scale
                    self.rect(cx, cy, cx + scale - 1, cy + scale - 1, color)
            x += 4 * scale
        return x

    def png(self) -> bytes:
        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(
                ">I", zlib.crc32(kind + data) & 0xFFFFFFFF
            )

        stride = 3 * self.width
        raw = b"".join(
            b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (
            b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw, 6))
            + chunk(b"IEND", b"")
        )


def _nice(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.0f}"


def draw_cdf(c: Canvas, x: int, y: int, w: int, h: int, series: Mapping[str, Sequence[float]],
             colors: Mapping[str, RGB], title: str) -> None:  # fmt: skip
    c.text(x, y - 16, title)
    c.line(x, y + h, x + w, y + h, BLACK)
    c.line(x, y, x, y + h, BLACK)
    # Up to the largest p99, so one policy's long tail does not flatten the others.
    tails = [v[max(0, int(len(v) * 0.99) - 1)] for v in series.values() if v]
    top = max(tails, default=1.0) * 1.1 or 1.0
    for k in range(5):
        gx = x + k * w // 4
        c.line(gx, y + h, gx, y + h + 3, BLACK)
        c.text(gx - 8, y + h + 6, _nice(top * k / 4))
        gy = y + h - k * h // 4
        c.line(x + 1, gy, x + w, gy, GREY)
        c.text(x - 30, gy - 4, f"{k * 25}")
    c.text(x + w - 120, y + h + 20, "TTFT S")
    for name, values in series.items():
        if not values:
            continue
        n = len(values)
        px, py = x, y + h
        for i, v in enumerate(values):
            qx = x + int(min(v, top) / top * w)
            qy = y + h - int((i + 1) / n * h)
            c.line(px, py, qx, py, colors[name], 2)
            c.line(qx, py, qx, qy, colors[name], 2)
            px, py = qx, qy


def draw_bars(c: Canvas, x: int, y: int, w: int, h: int, values: Mapping[str, float],
              colors: Mapping[str, RGB], title: str) -> None:  # fmt: skip
    c.text(x, y - 16, title)
    c.line(x, y + h, x + w, y + h, BLACK)
    top = max(values.values(), default=1.0) * 1.15 or 1.0
    n = max(len(values), 1)
    slot = w // n
    for i, (name, v) in enumerate(values.items()):
        bx = x + i * slot + slot // 6
        c.rect(bx, y + h - int(v / top * h), bx + slot * 2 // 3, y + h - 1, colors[name])
        c.text(bx, y + h - int(v / top * h) - 14, _nice(v))


def render(runs: Sequence[Mapping[str, Any]], path: str | Path) -> None:
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    colors = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(policies)}
    row_h, width = 300, 980
    c = Canvas(width, 60 + row_h * len(workloads))
    lx = 20
    for p in policies:  # legend
        c.rect(lx, 16, lx + 14, 30, colors[p])
        lx = c.text(lx + 20, 18, p) + 24
    for k, wl in enumerate(workloads):
        top = 90 + k * row_h
        mine = {r["policy"]: r for r in runs if r["workload"] == wl}
        draw_cdf(c, 60, top, 520, row_h - 90, {p: r["ttft_sorted"] for p, r in mine.items()},
                 colors, f"{wl}: TTFT CDF (%)")  # fmt: skip
        draw_bars(c, 660, top, 300, row_h - 90, {p: float(r["out_tok_s"]) for p, r in mine.items()},
                  colors, f"{wl}: OUTPUT TOK/S")  # fmt: skip
    Path(path).write_bytes(c.png())
