"""Request bodies -> validated request models, without stalling the event loop on large ones.

Parsing and validating JSON costs time that grows with the body's JSON values, and pydantic holds
the GIL for the whole call, so a thread would not help: on the 2-core machine an 8 MiB body of
tiny chat messages took 1.35 s and an 8 MiB token-id prompt 2.4 s, and every stream the server
was sending waited that long for its next token. Bodies over `INLINE_MAX_BYTES` are therefore
parsed in a small pool of worker processes (spawned at start; killed with the server, as they
run `die_with_parent`; niced, so that their CPU goes to the engine first), which send back the
validated request, small by `protocol`'s bounds (one string per message, at most MAX_MESSAGES of
them, a token-id prompt no longer than the context), or the validation errors without their
inputs. Smaller bodies are validated where they arrive: at most 2.7 ms for the slowest 16 KiB
body measured (a token-id prompt).

Errors are raised as FastAPI's `RequestValidationError`, so the one handler in `errors` words
every 400 alike (a body that is not JSON names the byte where it stops being JSON).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from loraplex.adapters_registry.base import ErrorKind
from loraplex.server.engine.parent_death import die_with_parent
from loraplex.server.errors import ApiError, InvalidRequest
from loraplex.server.protocol import MAX_PROMPT_TOKENS_KEY

log = logging.getLogger(__name__)

INLINE_MAX_BYTES = 16 * 1024
# The workers yield the CPU to the engine: on a machine as small as the 2-core CI one, a worker
# validating a hostile 8 MiB body (0.5-1.4 s of CPU) otherwise takes a core from the engine's
# steps, and every stream's tokens slow down with it.
WORKER_NICENESS = 10

M = TypeVar("M", bound=BaseModel)

_JSON_POSITION = re.compile(r" at line (\d+) column (\d+)$")


class BodyParserUnavailable(ApiError):
    kind = ErrorKind.UNAVAILABLE
    code = "body_parser_unavailable"


def _byte_offset(raw: bytes, line: int, column: int) -> int:
    start = 0
    for _ in range(line - 1):
        start = raw.index(b"\n", start) + 1
    return max(start + column - 1, 0)


def _portable_errors(raw: bytes, error: ValidationError) -> list[dict[str, Any]]:
    """pydantic's errors as FastAPI reports a body's: location under `body`, no input (it may be
    megabytes), a JSON syntax error at its byte offset."""
    errors = []
    for err in error.errors(include_url=False, include_input=False, include_context=False):
        loc: tuple[Any, ...] = ("body", *err["loc"])
        msg = err["msg"]
        if err["type"] == "json_invalid" and (at := _JSON_POSITION.search(msg)):
            loc = ("body", _byte_offset(raw, int(at.group(1)), int(at.group(2))))
            msg = msg[: at.start()]
        errors.append({"type": err["type"], "loc": loc, "msg": msg})
    return errors


def validate(model: type[M], raw: bytes, max_prompt_tokens: int) -> M | list[dict[str, Any]]:
    """The request `raw` holds, or its errors (what a worker process returns)."""
    try:
        return model.model_validate_json(raw, context={MAX_PROMPT_TOKENS_KEY: max_prompt_tokens})
    except ValidationError as e:
        return _portable_errors(raw, e)


def _start_worker() -> None:
    die_with_parent()
    os.nice(WORKER_NICENESS)


def _started() -> None:
    """Nothing: a task that makes the pool start a worker."""


def _is_json(content_type: str | None) -> bool:
    """FastAPI's rule: no Content-Type, or a JSON one (`application/json`, `*/*+json`)."""
    if content_type is None:
        return True
    subtype = content_type.split(";", 1)[0].strip().lower().rpartition("/")[2]
    return subtype == "json" or subtype.endswith("+json")


class BodyParser:
    """Validates request bodies; owns the worker processes for large ones (`start`, `close`)."""

    def __init__(self, processes: int, inline_max_bytes: int = INLINE_MAX_BYTES) -> None:
        self._processes = processes
        self._inline_max_bytes = inline_max_bytes
        self._pool: ProcessPoolExecutor | None = None

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            self._processes,
            mp_context=multiprocessing.get_context("spawn"),  # vLLM and torch live here
            initializer=_start_worker,
        )

    async def start(self) -> None:
        """Start the workers now (a spawn takes ~1 s), not on the first large body."""
        self._pool = self._new_pool()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(
            loop.run_in_executor(self._pool, _started) for _ in range(self._processes)
        ))  # fmt: skip

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    async def parse(
        self, raw: bytes, content_type: str | None, model: type[M], max_prompt_tokens: int
    ) -> M:
        """The validated request; `RequestValidationError` (a 400) for an invalid body."""
        if not _is_json(content_type):
            raise InvalidRequest(
                f"The body must be JSON (`Content-Type: application/json`), not "
                f"`{content_type[:100] if content_type else ''}`."
            )
        if len(raw) <= self._inline_max_bytes or self._pool is None:
            result = validate(model, raw, max_prompt_tokens)
        else:
            result = await self._in_worker(model, raw, max_prompt_tokens)
        if isinstance(result, list):
            raise RequestValidationError(result)
        return result

    async def _in_worker(
        self, model: type[M], raw: bytes, max_prompt_tokens: int
    ) -> M | list[dict[str, Any]]:
        pool = self._pool
        assert pool is not None
        try:
            return await asyncio.get_running_loop().run_in_executor(
                pool, validate, model, raw, max_prompt_tokens
            )
        except BrokenProcessPool as e:  # a worker died (the OOM killer): start new ones
            log.error("a body-parsing worker died; starting new ones")
            if self._pool is pool:
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
            raise BodyParserUnavailable(
                "The server could not parse this request now; retry.", headers={"Retry-After": "1"}
            ) from e
