"""Issue 45, finding 7: every numeric field, list and string of a request body has a bound, and a
value past it is a 400 naming the field and the bound, never a 500 (`top_k` 2**64 was one).
Logprobs on the wire are always finite JSON numbers. Bodies are parsed by `request_body`: large
ones in a worker process, whose errors read as the inline parser's.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import httpx
import pytest
from fastapi.exceptions import RequestValidationError

from bench.loadgen.server import LiveServer
from loraplex.server.errors import MAX_ECHO_BYTES
from loraplex.server.protocol import (
    MAX_MESSAGES,
    MAX_N,
    MAX_NAME_CHARS,
    MAX_STOP_CHARS,
    MAX_TOKEN_COUNT,
    MAX_TOP_K,
    ChatCompletionRequest,
    CompletionRequest,
)
from loraplex.server.request_body import BodyParser
from loraplex.server.served_request import MIN_LOGPROB, finite_logprobs
from tests.support.bystanders import MALLORY_KEY, Bystanders, base_model

CHAT = [{"role": "user", "content": "Hi"}]


# --- logprobs on the wire (unit) ------------------------------------------------------------


def _position(values: dict[int, float]) -> dict[int, Any]:
    from vllm.logprobs import Logprob

    return {token: Logprob(value, rank, None) for rank, (token, value) in
            enumerate(values.items(), start=1)}  # fmt: skip


def test_nan_and_infinite_logprobs_go_out_as_finite_numbers() -> None:
    """A batch poisoned by a broken adapter gives NaN logprobs: before vLLM's response builder
    sees them (whole responses and stream chunks alike) they are MIN_LOGPROB for NaN and -inf (no
    probability to report) and 0 for +inf (no log-probability is above it), so the wire carries
    strict JSON; in both of vLLM's forms (a dict per position, FlatLogprobs)."""
    from vllm.logprobs import FlatLogprobs

    values = [{1: math.nan, 2: math.inf, 3: -math.inf}, {2: math.inf, 1: math.nan},
              {3: -math.inf, 1: -0.5}]  # fmt: skip
    listed = [_position(v) for v in values]
    flat = FlatLogprobs()
    for position in listed:
        flat.append(position)
    finite_logprobs(listed)
    finite_logprobs(flat)
    for form in (listed, flat):
        got = [[lp.logprob for lp in position.values()] for position in form]
        assert got == [[MIN_LOGPROB, 0.0, MIN_LOGPROB], [0.0, MIN_LOGPROB], [MIN_LOGPROB, -0.5]]
        json.dumps(got, allow_nan=False)


# --- the body parser (unit: a real worker process) -------------------------------------------


def _errors(raised: pytest.ExceptionInfo[RequestValidationError]) -> list[tuple[Any, str]]:
    return [(e["loc"], e["msg"]) for e in raised.value.errors()]


def test_large_bodies_parse_in_a_worker_as_small_ones_do_inline() -> None:
    """With a 64-byte inline limit every body below goes to the worker process; the request it
    returns and the errors it reports are what the inline parse gives."""

    async def parse_both(raw: bytes, model: type[Any]) -> list[Any]:
        worker = BodyParser(1, inline_max_bytes=64)
        inline = BodyParser(1)  # never started: everything inline
        await worker.start()
        try:
            out = []
            for parser in (worker, inline):
                try:
                    out.append(await parser.parse(raw, "application/json", model, 2048))
                except RequestValidationError as e:
                    out.append(e.errors())
            return out
        finally:
            worker.close()

    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = {"model": "m", "messages": [{"role": "user", "content": parts}] * 3}
    in_worker, inline = asyncio.run(parse_both(json.dumps(body).encode(), ChatCompletionRequest))
    assert in_worker == inline and in_worker.messages[0].content == "ab"
    ids = json.dumps({"model": "m", "prompt": list(range(3000))}).encode()
    in_worker, inline = asyncio.run(parse_both(ids, CompletionRequest))
    assert in_worker == inline
    assert in_worker[0]["loc"] == ("body", "prompt") and "at most 2048" in in_worker[0]["msg"]
    broken = b'{"model": "m",\n "messages": [' + b" " * 80 + b"}"
    in_worker, inline = asyncio.run(parse_both(broken, ChatCompletionRequest))
    assert in_worker == inline and in_worker[0]["type"] == "json_invalid"
    assert in_worker[0]["loc"] == ("body", broken.index(b"}"))


# --- on the shared server ----------------------------------------------------------------------


def _post(server: LiveServer, route: str, raw: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {MALLORY_KEY}", "content-type": "application/json"}
    return httpx.post(server.base_url + route, content=raw, headers=headers, timeout=120)


def _chat(base: str, **fields: Any) -> dict[str, Any]:
    return {"model": base, "messages": CHAT, "max_tokens": 2, **fields}


@pytest.mark.parametrize(
    ("path", "fields", "param", "bound"),
    [
        ("chat", {"top_k": 2**64}, "top_k", f"less than or equal to {MAX_TOP_K}"),
        ("chat", {"top_k": -2}, "top_k", "greater than or equal to -1"),
        ("chat", {"seed": 2**63}, "seed", "less than 9223372036854775808"),
        ("chat", {"seed": -(2**63) - 1}, "seed", "greater than or equal to"),
        ("chat", {"max_tokens": 2**31}, "max_tokens", f"less than or equal to {MAX_TOKEN_COUNT}"),
        ("chat", {"max_completion_tokens": 2**64}, "max_completion_tokens",
         f"less than or equal to {MAX_TOKEN_COUNT}"),
        ("chat", {"min_tokens": 10**30, "max_tokens": None}, "min_tokens",
         f"less than or equal to {MAX_TOKEN_COUNT}"),
        ("chat", {"n": MAX_N + 1}, "n", f"less than or equal to {MAX_N}"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
         "less than or equal to 20"),
        ("text", {"logprobs": 6}, "logprobs", "less than or equal to 5"),
        ("chat", {"temperature": 1e309}, "temperature", "less than or equal to 2"),
        ("chat", {"presence_penalty": -1e309}, "presence_penalty", "greater than or equal to -2"),
        ("chat", {"repetition_penalty": 1e400}, "repetition_penalty", "less than or equal to 2"),
        ("chat", {"top_p": 1e-400}, "top_p", "greater than 0"),
        ("chat", {"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop", f"at most {MAX_STOP_CHARS}"),
        ("chat", {"messages": CHAT * (MAX_MESSAGES + 1)}, "messages",
         f"at most {MAX_MESSAGES} items"),
        ("chat", {"user": "u" * 257}, "user", "at most 256 characters"),
        ("chat", {"model": "m" * 257}, "model", "at most 256 characters"),
        ("text", {"prompt": [1] * 2049}, "prompt", "the context holds at most 2048"),
        ("text", {"prompt": [[1] * 2049]}, "prompt", "the context holds at most 2048"),
        ("text", {"prompt": [10**30]}, "prompt", "token ids must be in [0, 2147483647]"),
        ("text", {"prompt": [49152]}, "prompt", "token ids must be in [0, 49152)"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)  # fmt: skip
def test_a_field_past_its_bound_is_a_400_naming_it(
    shared_server: LiveServer,
    bystanders: Bystanders,
    path: str,
    fields: dict[str, Any],
    param: str,
    bound: str,
) -> None:
    base = base_model(shared_server)
    if path == "chat":
        route, body = "/v1/chat/completions", _chat(base, **fields)
    else:
        route, body = "/v1/completions", {"model": base, "prompt": "Hi", "max_tokens": 2, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    r = _post(shared_server, route, json.dumps(body).encode())  # Infinity as JSON5 writes it
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and bound in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_an_unknown_model_is_quoted_in_a_short_excerpt(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    """The longest `model` the bound lets through, of 4-byte characters (1 KiB): its 404 quotes
    at most MAX_ECHO_BYTES of it, cut between two characters."""
    model = "\U0001f600" * MAX_NAME_CHARS
    r = _post(shared_server, "/v1/chat/completions", json.dumps(_chat(model)).encode())
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model"), error
    quoted = error["message"].split("`")[1]
    assert quoted.endswith("...") and model.startswith(quoted[:-3]), error
    assert len(quoted.encode()) <= MAX_ECHO_BYTES, len(quoted.encode())


def test_json_nested_past_the_parser_limit_is_a_400(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    """20,000 levels of arrays: the parser stops at its recursion limit (a few hundred)."""
    raw = b'{"model": "m", "messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    r = _post(shared_server, "/v1/chat/completions", raw)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is None and "recursion limit" in error["message"], error
    bystanders.assert_unchanged()


def test_bystanders_unchanged_after_the_bounds(bystanders: Bystanders) -> None:
    bystanders.assert_unchanged()
