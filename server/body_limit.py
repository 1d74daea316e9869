"""A cap on the size of request bodies, enforced before anything parses them.

Without it a body of any size is read whole into memory and parsed on the event loop (and its
prompt tokenized there too), so one huge request stalls every stream the server is sending. A body
over `http.max_body_bytes` is answered 413 in OpenAI's error envelope, naming the setting and its
value: at once when its Content-Length says so, otherwise as soon as the bytes read pass the cap.
A body within the cap is buffered (it is bounded) and handed to the app unchanged.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraplex.server.errors import error_body

# A refused body is still read (and dropped) up to this many bytes before the 413 is sent: clients
# such as httpx read the response only once they have sent the whole body, and a server that
# closes with bytes unread resets the connection, so they would report a connection error instead
# of the 413. Past this, the connection is closed unread.
_DRAIN_MAX_BYTES = 256 * 1024 * 1024


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and (length := int(declared)) > self.max_bytes:
            await _drain(receive)
            await self._refuse(scope, receive, send, f"is {length} bytes")
            return
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
                await self._refuse(scope, receive, send, f"passed {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        message = (
            f"The request body {size}; the limit is {self.max_bytes} bytes "
            "(setting `http.max_body_bytes`)."
        )
        body = error_body(message, "invalid_request_error", "request_too_large")
        response = JSONResponse(body, status_code=413, headers={"connection": "close"})
        await response(scope, receive, send)


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
