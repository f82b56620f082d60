"""Reading a config file: JSON with the comments and trailing commas DeepSpeed's configs carry.

DeepSpeed reads its config with ``hjson``, so a ``ds_config.json`` written for it may hold ``//``
and ``#`` line comments, ``/* */`` block comments and a comma before ``}`` or ``]``. zero3 reads
exactly those on top of JSON, with no new dependency: `strip_comments_and_trailing_commas` blanks
them out (outside strings only, keeping every other character where it was, so ``json``'s line
and column still point into the file) and ``json`` parses the rest. The rest of hjson (unquoted
keys or strings, ``'''`` multiline strings, newlines for commas) is refused, naming the place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ZeroConfigError

READS = ("JSON plus // and # line comments, /* */ block comments and trailing commas (not the rest of hjson: "
         "unquoted keys or strings, ''' multiline strings, newlines in place of commas)")
"""What zero3 reads from a config file, as the refusal of anything else says it."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The JSON object in the file at ``path``, comments and trailing commas allowed; a key given
    twice in one object is refused, as DeepSpeed refuses it. Every failure is a `ZeroConfigError`
    naming the file (the ranks agree on it: one rank's missing file raises on every rank)."""
    try:
        with open(path, encoding="utf-8-sig") as fh:  # a byte-order mark, as Windows editors write, skipped
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ZeroConfigError(f"config file {str(path)!r} cannot be read: {exc}") from exc
    data = loads_config_text(text, path)
    if not isinstance(data, dict):
        raise ZeroConfigError(f"{path}: a config is a JSON object, got a {type(data).__name__}")
    return data


def loads_config_text(text: str, path: str | Path = "<config>") -> Any:
    """``json.loads`` of ``text`` after `strip_comments_and_trailing_commas`, refusing duplicate keys
    (naming the line and column of the second one: `_duplicate_place`)."""
    stripped = strip_comments_and_trailing_commas(text, path)
    try:
        return json.loads(stripped, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ZeroConfigError(f"{path}: not valid JSON ({exc}); zero3 reads {READS}") from exc
    except _DuplicateKey as dup:
        key, place = dup.key, ""
        found = _duplicate_place(stripped)
        if found is not None:  # always, for text json parsed that far; the key json saw otherwise
            key, (line, col), (line0, col0) = found
            place = f" at line {line} column {col} (first at line {line0} column {col0})"
        raise ZeroConfigError(f"{path}: the key {key!r} is given twice in one object{place}; keep one "
                              "(DeepSpeed refuses it too)") from None


def strip_comments_and_trailing_commas(text: str, path: str | Path = "<config>") -> str:
    """``text`` with each comment and each trailing comma outside strings turned into spaces (a
    comment's newlines kept), so the result has the same length, lines and columns. A comma is
    trailing when a value comes before it and only whitespace or comments before the ``}``/``]``
    after it; ``[,]`` or ``[1,,]`` keep their commas, and ``json`` refuses them."""
    out = list(text)
    n, i = len(text), 0
    last = ""  # the last significant character outside comments: "," after a value may trail
    comma = -1  # the index of a comma after a value, while only blanks and comments follow it
    while i < n:
        c = text[i]
        if c == '"':
            i = _string_end(text, i)
            last, comma = '"', -1
            continue
        if c == "#" or text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            out[i:end] = " " * (end - i)
            i = end
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            if end < 0:
                line, col = _line_col(text, i)
                raise ZeroConfigError(f"{path}: a /* comment at line {line} column {col} is never closed with */")
            out[i:end + 2] = [ch if ch == "\n" else " " for ch in text[i:end + 2]]
            i = end + 2
            continue
        if c in " \t\r\n":
            i += 1
            continue
        if c in "}]" and comma >= 0:
            out[comma] = " "
        comma = i if c == "," and last not in ("", ",", "{", "[", ":") else -1
        last = c
        i += 1
    return "".join(out)


def _string_end(text: str, start: int) -> int:
    """The index after the string that opens at ``start`` (a backslash escapes the next character);
    the text's length when it is never closed, which ``json`` then refuses with the place."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return len(text)


def _line_col(text: str, index: int) -> tuple[int, int]:
    """1-based line and column of ``index``, as ``json`` names places."""
    line = text.count("\n", 0, index) + 1
    return line, index - (text.rfind("\n", 0, index) + 1) + 1


class _DuplicateKey(Exception):
    """A key given twice in one JSON object (``json`` tells no place; `_duplicate_place` finds it)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: a key given twice (json's last-one-wins would keep one
    silently) is refused, as DeepSpeed refuses it."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _duplicate_place(text: str) -> tuple[str, tuple[int, int], tuple[int, int]] | None:
    """The first key (in text order) given twice in one object of the JSON ``text``, with the line
    and column of its second and first occurrence; None when there is none. ``text`` is JSON (comments
    already blanked) up to that key at least: ``json`` parsed past it before its hook saw the pair."""
    objects: list[dict[str, int] | None] = []  # per open {...} its keys' indices; None for a [...]
    expect_key = False  # the next string in the innermost object is a key
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if expect_key and objects and objects[-1] is not None:
                key = json.loads(text[i:end])
                seen = objects[-1]
                if key in seen:
                    return key, _line_col(text, i), _line_col(text, seen[key])
                seen[key] = i
            expect_key = False
            i = end
            continue
        if c == "{":
            objects.append({})
            expect_key = True
        elif c == "[":
            objects.append(None)
        elif c in "}]":
            if objects:
                objects.pop()
        elif c == ",":
            expect_key = bool(objects) and objects[-1] is not None
        i += 1
    return None
