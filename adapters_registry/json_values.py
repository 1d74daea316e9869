"""Numbers read from an adapter's JSON (its config, a safetensors header): Python's `bool` is an
`int`, so JSON `true` would pass as 1 where a rank, a dimension or an offset is expected."""

from __future__ import annotations

from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
