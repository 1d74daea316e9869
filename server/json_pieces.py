"""Whole JSON responses that cannot stall the event loop, however large they are.

A whole chat response of n=16 choices of 2,047 tokens with top_logprobs=20 is 48 MB of JSON;
`json.dumps` took 2.2 s over it in one call holding the GIL (2-core machine), and Starlette's
JSONResponse makes that call on the event loop: every stream of the server waited 2.2 s (a
thread would not help: the call never lets go of the GIL, nor would joining 48 MB at the end,
59-72 ms). A value holding a list longer than SHALLOW_LIST_ITEMS is therefore sent as a chunked
body of pieces: every list in slices of at most PIECE_ITEMS items, one `json.dumps` call each (a
slice of 64 chat logprob entries, 21 objects each: ~2-4 ms), dicts and lists holding larger
ones walked, and the event loop runs other tasks between pieces. Smaller values are one
JSONResponse, as before. The text is Starlette's JSONResponse's (compact separators, non-ASCII
kept, NaN refused).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

PIECE_ITEMS = 64
# A container whose every list holds at most this many items is encoded in one call.
SHALLOW_LIST_ITEMS = 32

_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


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
                yield ("" if first else ",") + _dumps(run)[1:-1]
                first, run = False, []
            if not _shallow(item):
                yield "" if first else ","
                yield from pieces(item)
                first = False
        if run:
            yield ("" if first else ",") + _dumps(run)[1:-1]
        yield "]"
    else:
        yield _dumps(value)


async def _chunks(value: Any) -> AsyncIterator[bytes]:
    for piece in pieces(value):
        yield piece.encode()
        await asyncio.sleep(0)  # other tasks run between pieces


def json_response(value: Any) -> Response:
    """`value` as a JSON response: whole when it is small, in pieces when it is not."""
    if _shallow(value):
        return JSONResponse(value)
    return StreamingResponse(_chunks(value), media_type="application/json")
