"""JSON read from an adapter's files (its config, a safetensors header), bounded before it is
trusted, and quoted in errors without echoing the file.

Python's `bool` is an `int`, so JSON `true` would pass as 1 where a rank, a dimension or an offset
is expected (`is_int`). An integer of thousands of digits makes `json.loads` raise a ValueError
(past 4,300 digits) or builds a number nobody should print: integers longer than MAX_INT_DIGITS
are read as `LongInteger`, which no field accepts and whose repr is short (`parse_int`). Errors
quote a value through `excerpt`, never whole. `parse_object_entrywise` parses a large top-level
object one entry at a time, so a worker thread parsing it lets the event loop run in between.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from json.decoder import WHITESPACE  # type: ignore[attr-defined]
from typing import Any, TypeGuard

# 20 digits hold every 64-bit integer; ranks, dimensions and offsets are far smaller.
MAX_INT_DIGITS = 20
EXCERPT_CHARS = 80


class LongInteger:
    """An integer of more than MAX_INT_DIGITS digits, not converted (see the module docstring)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits; at most {MAX_INT_DIGITS} are read>"


def parse_int(text: str) -> int | LongInteger:
    """json's `parse_int` hook: an int, or a LongInteger past MAX_INT_DIGITS digits."""
    digits = len(text.lstrip("-"))
    return int(text) if digits <= MAX_INT_DIGITS else LongInteger(digits)


def excerpt(value: object) -> str:
    """`repr(value)`, cut to EXCERPT_CHARS characters: what an error may quote of a file."""
    text = repr(value)
    return text if len(text) <= EXCERPT_CHARS else f"{text[: EXCERPT_CHARS - 3]}..."


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_object_entrywise(
    text: str, max_entries: int, on_too_many: Callable[[int], Exception]
) -> dict[str, Any]:
    """The JSON object `text`, parsed one top-level entry at a time by json's C scanner.

    One `json.loads` of a 4 MB safetensors header holds the GIL, stalling every stream, for
    50-140 ms; entry by entry, a waiting thread gets it at the next switch interval. Raises
    `on_too_many(max_entries)` past `max_entries` entries, ValueError (json.JSONDecodeError) on
    malformed JSON and RecursionError on nesting deeper than the scanner's stack."""
    decoder = json.JSONDecoder(parse_int=parse_int)
    scan = decoder.scan_once  # type: ignore[attr-defined]

    def skip(i: int) -> int:
        return int(WHITESPACE.match(text, i).end())

    def expect(i: int, char: str) -> int:
        if text[i : i + 1] != char:
            raise json.JSONDecodeError(f"Expecting {char!r}", text, i)
        return skip(i + 1)

    out: dict[str, Any] = {}
    i = expect(skip(0), "{")
    if text[i : i + 1] == "}":
        i = skip(i + 1)
    else:
        while True:
            if text[i : i + 1] != '"':
                raise json.JSONDecodeError("Expecting property name in double quotes", text, i)
            key, i = _scanned(scan, text, i)
            value, i = _scanned(scan, text, expect(skip(i), ":"))
            out[key] = value
            if len(out) > max_entries:
                raise on_too_many(max_entries)
            i = skip(i)
            if text[i : i + 1] == "}":
                i = skip(i + 1)
                break
            i = expect(i, ",")
    if i != len(text):
        raise json.JSONDecodeError("Extra data", text, i)
    return out


def _scanned(scan: Any, text: str, i: int) -> tuple[Any, int]:
    try:
        value, end = scan(text, i)
    except StopIteration as e:  # the scanner's way of saying "no value here"
        raise json.JSONDecodeError("Expecting value", text, e.value) from None
    return value, int(end)
