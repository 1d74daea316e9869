"""Whole JSON responses that cannot stall the event loop, however large they are.

A whole chat response of n=16 choices of 2,047 tokens with top_logprobs=20 is 48 MB of JSON;
`json.dumps` took 2.2 s over it in one call holding the GIL (2-core machine), and Starlette's
JSONResponse makes that call on the event loop: every stream of the server waited 2.2 s (a
thread would not help: the call never lets go of the GIL, nor would joining 48 MB at the end,
59-72 ms); pydantic's `model_dump_json` over vLLM's response object is one such call (128 ms at
512 tokens a choice). A value holding a list longer than SHALLOW_LIST_ITEMS is therefore sent as
a chunked body of pieces: every list in slices of at most PIECE_ITEMS items, one `json.dumps`
call each (a slice of 64 chat logprob entries, 21 objects each: ~2-4 ms; as vLLM's models, 14 ms
at most), dicts and lists holding larger ones walked, and the event loop runs other tasks between
pieces. Smaller values are one JSONResponse, as before. The text is Starlette's JSONResponse's
(compact separators, non-ASCII kept, NaN refused).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import BaseModel
from starlette.responses import JSONResponse, Response, StreamingResponse

PIECE_ITEMS = 64
# A container whose every list holds at most this many items is encoded in one call.
SHALLOW_LIST_ITEMS = 32

_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def _items(run: list[Any]) -> str:
    """A slice's items, comma-separated: pydantic models (the items of a list `unfolded` kept)
    by their own `model_dump_json` (a non-finite float is null there), the rest in one call."""
    if isinstance(run[0], BaseModel):
        return ",".join(item.model_dump_json() for item in run)
    return _dumps(run)[1:-1]


def _shallow(value: Any) -> bool:
    """Small enough for one call as a slice item: scalars, short lists of shallow values, dicts
    of shallow values."""
    if isinstance(value, dict):
        return all(_shallow(v) for v in value.values())
    if isinstance(value, list):
        return len(value) <= SHALLOW_LIST_ITEMS and all(_shallow(v) for v in value)
    return True


def pieces(value: Any) -> Iterator[str]:
    """The JSON text of `value`, piece by piece."""
    if isinstance(value, dict) and not _shallow(value):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + _dumps(str(key)) + ":"
            yield from pieces(item)
        yield "}"
    elif isinstance(value, list) and not _shallow(value):
        yield "["
        run: list[Any] = []  # consecutive shallow items, encoded PIECE_ITEMS at a time
        first = True
        for item in value:
            if _shallow(item):
                run.append(item)
                if len(run) < PIECE_ITEMS:
                    continue
            if run:
                yield ("" if first else ",") + _items(run)
                first, run = False, []
            if not _shallow(item):
                yield "" if first else ","
                yield from pieces(item)
                first = False
        if run:
            yield ("" if first else ",") + _items(run)
        yield "]"
    else:
        yield _dumps(value)


async def _chunks(value: Any) -> AsyncIterator[bytes]:
    for piece in pieces(value):
        yield piece.encode()
        await asyncio.sleep(0)  # other tasks run between pieces


def _long_lists(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], list[Any]]]:
    """(path, list) of every list longer than SHALLOW_LIST_ITEMS in a model's fields, and in the
    models and short lists they hold (a long list's own items are not searched)."""
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from _long_lists(getattr(value, name), (*path, name))
    elif isinstance(value, list):
        if len(value) > SHALLOW_LIST_ITEMS:
            yield path, value
        else:
            for i, item in enumerate(value):
                yield from _long_lists(item, (*path, i))


def unfolded(model: BaseModel) -> Any:
    """`model` as `pieces` takes it: its JSON dump (`model_dump(mode="json")`, its own
    serializers applied) except that each list longer than SHALLOW_LIST_ITEMS keeps its items as
    models, which are dumped slice by slice as the pieces go out."""
    found = list(_long_lists(model, ()))
    exclude: dict[Any, Any] = {}
    for path, _ in found:
        spec = exclude
        for key in path[:-1]:
            spec = spec.setdefault(key, {})
        spec[path[-1]] = True
    value = model.model_dump(mode="json", exclude=exclude or None)
    for path, items in found:
        parent = value
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = items
    return value


def json_response(value: Any) -> Response:
    """`value` as a JSON response: whole when it is small, in pieces when it is not."""
    if _shallow(value):
        return JSONResponse(value)
    return StreamingResponse(_chunks(value), media_type="application/json")
