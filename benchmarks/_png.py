"""A small line-plot PNG writer (zlib + struct only), so benchmarks can draw figures without matplotlib.

`Figure` holds side-by-side panels; each `Panel` has a title, axis ranges and named series, drawn as
1-pixel lines with tick labels in a 5x7 bitmap font (digits, a few signs, lower- and upper-case
letters). Enough for a loss curve in the docs; not a plotting library.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field

RGB = tuple[int, int, int]
COLORS: list[RGB] = [(0, 0, 0), (214, 39, 40), (31, 119, 180), (44, 160, 44), (255, 127, 14), (148, 103, 189)]

# 5x7 glyphs: 7 rows of 5 columns ("#" = ink), rows separated by "|".
_GLYPHS = {
    "0": ".###.|#...#|#..##|#.#.#|##..#|#...#|.###.", "1": "..#..|.##..|..#..|..#..|..#..|..#..|.###.",
    "2": ".###.|#...#|....#|...#.|..#..|.#...|#####", "3": "#####|...#.|..#..|...#.|....#|#...#|.###.",
    "4": "...#.|..##.|.#.#.|#..#.|#####|...#.|...#.", "5": "#####|#....|####.|....#|....#|#...#|.###.",
    "6": "..##.|.#...|#....|####.|#...#|#...#|.###.", "7": "#####|....#|...#.|..#..|.#...|.#...|.#...",
    "8": ".###.|#...#|#...#|.###.|#...#|#...#|.###.", "9": ".###.|#...#|#...#|.####|....#|...#.|.##..",
    ".": ".....|.....|.....|.....|.....|.##..|.##..", "-": ".....|.....|.....|#####|.....|.....|.....",
    "+": ".....|..#..|..#..|#####|..#..|..#..|.....", "%": "##...|##..#|...#.|..#..|.#...|#..##|...##",
    "=": ".....|.....|#####|.....|#####|.....|.....", ",": ".....|.....|.....|.....|.##..|..#..|.#...",
    "(": "...#.|..#..|.#...|.#...|.#...|..#..|...#.", ")": ".#...|..#..|...#.|...#.|...#.|..#..|.#...",
    "/": ".....|....#|...#.|..#..|.#...|#....|.....", ":": ".....|.##..|.##..|.....|.##..|.##..|.....",
    " ": ".....|.....|.....|.....|.....|.....|.....",
    "a": ".....|.....|.###.|....#|.####|#...#|.####", "b": "#....|#....|#.##.|##..#|#...#|#...#|####.",
    "c": ".....|.....|.###.|#....|#....|#...#|.###.", "d": "....#|....#|.##.#|#..##|#...#|#...#|.####",
    "e": ".....|.....|.###.|#...#|#####|#....|.###.", "f": "..##.|.#..#|.#...|###..|.#...|.#...|.#...",
    "g": ".....|.####|#...#|#...#|.####|....#|.###.", "h": "#....|#....|#.##.|##..#|#...#|#...#|#...#",
    "i": "..#..|.....|.##..|..#..|..#..|..#..|.###.", "k": "#....|#....|#..#.|#.#..|##...|#.#..|#..#.",
    "l": ".##..|..#..|..#..|..#..|..#..|..#..|.###.", "m": ".....|.....|##.#.|#.#.#|#.#.#|#...#|#...#",
    "n": ".....|.....|#.##.|##..#|#...#|#...#|#...#", "o": ".....|.....|.###.|#...#|#...#|#...#|.###.",
    "p": ".....|.....|####.|#...#|####.|#....|#....", "q": ".....|.....|.##.#|#..##|.####|....#|....#",
    "r": ".....|.....|#.##.|##..#|#....|#....|#....", "s": ".....|.....|.####|#....|.###.|....#|####.",
    "t": ".#...|.#...|###..|.#...|.#...|.#..#|..##.", "u": ".....|.....|#...#|#...#|#...#|#..##|.##.#",
    "v": ".....|.....|#...#|#...#|#...#|.#.#.|..#..", "w": ".....|.....|#...#|#...#|#.#.#|#.#.#|.#.#.",
    "x": ".....|.....|#...#|.#.#.|..#..|.#.#.|#...#", "y": ".....|.....|#...#|#...#|.####|....#|.###.",
    "z": ".....|.....|#####|...#.|..#..|.#...|#####", "E": "#####|#....|#....|####.|#....|#....|#####",
    "L": "#....|#....|#....|#....|#....|#....|#####", "M": "#...#|##.##|#.#.#|#.#.#|#...#|#...#|#...#",
    "W": "#...#|#...#|#...#|#.#.#|#.#.#|##.##|#...#", "Z": "#####|....#|...#.|..#..|.#...|#....|#####",
    "G": ".###.|#...#|#....|#.###|#...#|#...#|.###.", "P": "####.|#...#|#...#|####.|#....|#....|#....",
    "T": "#####|..#..|..#..|..#..|..#..|..#..|..#..",
}
_FONT = {ch: rows.replace("|", "") for ch, rows in _GLYPHS.items()}
assert all(len(rows) == 35 for rows in _FONT.values())


@dataclass
class Panel:
    title: str
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    series: list[tuple[str, list[float], list[float], RGB]] = field(default_factory=list)  # name, xs, ys, color
    y_label: str = ""
    x_label: str = ""

    def add(self, name: str, xs: list[float], ys: list[float], color: RGB | None = None) -> None:
        self.series.append((name, xs, ys, color if color is not None else COLORS[len(self.series) % len(COLORS)]))


class Figure:
    def __init__(self, panels: list[Panel], panel_size: tuple[int, int] = (460, 320)) -> None:
        self.panels = panels
        self.pw, self.ph = panel_size
        self.w, self.h = self.pw * len(panels), self.ph
        self.pixels = bytearray(b"\xff" * (self.w * self.h * 3))

    def _set(self, x: int, y: int, color: RGB) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = (y * self.w + x) * 3
            self.pixels[i: i + 3] = bytes(color)

    def _line(self, x0: int, y0: int, x1: int, y1: int, color: RGB) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self._set(x0, y0, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, color: RGB = (0, 0, 0)) -> None:
        for k, ch in enumerate(s):
            glyph = _FONT.get(ch, _FONT[" "])
            for row in range(7):
                for col in range(5):
                    if glyph[row * 5 + col] == "#":
                        self._set(x + 6 * k + col, y + row, color)

    def _panel(self, index: int, panel: Panel) -> None:
        left, top = index * self.pw + 58, 24
        right, bottom = (index + 1) * self.pw - 12, self.ph - 34
        (x0, x1), (y0, y1) = panel.x_range, panel.y_range

        def px(x: float) -> int:
            return round(left + (x - x0) / (x1 - x0) * (right - left))

        def py(y: float) -> int:
            return round(bottom - (y - y0) / (y1 - y0) * (bottom - top))

        self.text(left, 8, panel.title)
        self._line(left, bottom, right, bottom, (0, 0, 0))
        self._line(left, top, left, bottom, (0, 0, 0))
        for t in _ticks(y0, y1):
            self._line(left - 3, py(t), left, py(t), (0, 0, 0))
            self._line(left + 1, py(t), right, py(t), (225, 225, 225))
            label = _fmt(t)
            self.text(left - 6 - 6 * len(label), py(t) - 3, label)
        for t in _ticks(x0, x1):
            self._line(px(t), bottom, px(t), bottom + 3, (0, 0, 0))
            label = _fmt(t)
            self.text(px(t) - 3 * len(label), bottom + 6, label)
        self.text(right - 6 * len(panel.x_label), bottom + 18, panel.x_label)
        self.text(index * self.pw + 4, top - 12, panel.y_label)
        for k, (name, xs, ys, color) in enumerate(panel.series):
            points = [(px(x), py(min(max(y, y0), y1))) for x, y in zip(xs, ys)]
            for (a, b), (c, d) in zip(points, points[1:]):
                self._line(a, b, c, d, color)
            self._line(right - 110, top + 8 + 11 * k, right - 96, top + 8 + 11 * k, color)
            self.text(right - 90, top + 5 + 11 * k, name, color)

    def save(self, path: str) -> None:
        for i, panel in enumerate(self.panels):
            self._panel(i, panel)
        raw = b"".join(b"\x00" + bytes(self.pixels[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)) \
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
        with open(path, "wb") as fh:
            fh.write(png)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = hi - lo
    step = 10 ** math.floor(math.log10(span / n))
    for mult in (1, 2, 5, 10):
        if span / (step * mult) <= n:
            step *= mult
            break
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    if abs(v) < 1e-12:
        return "0"
    if abs(v) >= 100 or float(v).is_integer():
        return f"{v:.0f}"
    return f"{v:.3g}"
