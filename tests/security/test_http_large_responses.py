"""A whole response is as large as n x max_tokens x (top_logprobs + 1) makes it (48 MB at n=16,
2,047 tokens, top_logprobs=20), and json.dumps over it held the event loop 2.2 s. Large ones go
out in pieces, with the event loop free between them (server/json_pieces.py); the text is the
same JSON."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.responses import JSONResponse, StreamingResponse

from loraplex.server.json_pieces import PIECE_ITEMS, json_response, pieces


def _entry(i: int) -> dict[str, Any]:
    return {"token": f"tök{i}", "logprob": -0.5 - i, "bytes": [116, 195, 182, 107]}


def _whole_response(tokens: int) -> dict[str, Any]:
    content = [{**_entry(i), "top_logprobs": [_entry(j) for j in range(20)]} for i in range(tokens)]
    text = {"tokens": ["a"] * tokens, "top_logprobs": [{"a": -1.0}] * tokens}
    choices = [{"index": i, "message": {"role": "assistant", "content": "ü" * 50},
                "logprobs": {"content": content}} for i in range(3)]  # fmt: skip
    return {"id": "x", "choices": choices, "text": text, "usage": {"total_tokens": 9}}


def _reference(value: Any) -> bytes:
    return bytes(JSONResponse(value).body)


@pytest.mark.parametrize(
    "value",
    [[], {}, [[]], [None] * 70, {"a": [1] * 100}, [{"a": [1] * 40}] * 3, [[1, [2] * 50]] * 2,
     "ü", 1.5, None, _whole_response(200)],
    ids=lambda v: type(v).__name__ + str(len(json.dumps(v))),
)  # fmt: skip
def test_pieces_are_the_same_json_as_one_call(value: Any) -> None:
    assert "".join(pieces(value)).encode() == _reference(value)


def test_a_large_response_goes_out_in_pieces_with_the_loop_free_between_them() -> None:
    value = _whole_response(2047)
    response = json_response(value)
    assert isinstance(response, StreamingResponse)

    async def read() -> tuple[bytes, int, int]:
        turns = 0
        running = True

        async def other_task() -> None:
            nonlocal turns
            while running:
                turns += 1
                await asyncio.sleep(0)

        other = asyncio.create_task(other_task())
        chunks = [chunk async for chunk in response.body_iterator]
        running = False
        await other
        return b"".join(chunks), len(chunks), turns  # type: ignore[arg-type]

    body, count, turns = asyncio.run(read())
    assert body == _reference(value)
    # 3 choices x 2047 entries in slices of PIECE_ITEMS, plus the text's lists and the frame.
    assert count >= 3 * (2047 // PIECE_ITEMS)
    assert turns >= count - 1  # the other task ran between every two pieces


def test_a_small_response_is_one_body() -> None:
    value = _whole_response(10)
    response = json_response(value)
    assert isinstance(response, JSONResponse) and response.body == _reference(value)
