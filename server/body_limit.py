"""A cap on the size of request bodies and on the time they take, enforced before anything parses
them.

Without it a body of any size is read whole into memory, so one huge request holds memory and
the work of parsing it. A body over `http.max_body_bytes` is answered 413 in OpenAI's error
envelope, naming the setting and its value: at once when its Content-Length says so, otherwise as
soon as the bytes read pass the cap. A body that has not all arrived `http.body_timeout_s` after
its headers is answered 408 (a client trickling it would otherwise hold its connection, and the
request, as long as it liked). A body within both is buffered (it is bounded) and handed to the
app unchanged.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.adapters_registry.base import ErrorKind
from loraplex.server.errors import ApiError, error_response

# A refused body is still read (and dropped) up to this many bytes before the 413 is sent: clients
# such as httpx read the response only once they have sent the whole body, and a server that
# closes with bytes unread resets the connection, so they would report a connection error instead
# of the 413. Past this, the connection is closed unread.
_DRAIN_MAX_BYTES = 256 * 1024 * 1024


class BodyTimeout(ApiError):
    kind = ErrorKind.TIMEOUT
    code = "timeout"


class BodyTooLarge(ApiError):
    kind = ErrorKind.TOO_LARGE
    code = "request_too_large"


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read(scope, receive)
        except TimeoutError:
            message = (
                f"The request body did not arrive within {self.timeout_s:g} s "
                "(setting `http.body_timeout_s`)."
            )
            await _close_with(scope, receive, send, BodyTimeout(message))
            return
        if isinstance(body, str):
            message = (
                f"The request body {body}; the limit is {self.max_bytes} bytes "
                "(setting `http.max_body_bytes`)."
            )
            await _close_with(scope, receive, send, BodyTooLarge(message))
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> list[Message] | str:
        """The body's messages, or how it passed the cap (its rest read and dropped)."""
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and (length := int(declared)) > self.max_bytes:
            await _drain(receive)
            return f"is {length} bytes"
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client went away; the app sees that as the request's end
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive)
                return f"passed {self.max_bytes} bytes"
            if not message.get("more_body", False):
                break
        return messages


async def _close_with(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
    await error_response(error, {"connection": "close"})(scope, receive, send)


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of the request body, up to `_DRAIN_MAX_BYTES`."""
    dropped = 0
    while dropped < _DRAIN_MAX_BYTES:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        dropped += len(message.get("body", b""))


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that first returns the buffered messages, then defers to the server's (which
    reports the client's disconnect to streaming responses)."""
    pending = iter(messages)

    async def replayed() -> Message:
        return next(pending, None) or await receive()

    return replayed
