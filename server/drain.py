"""Graceful drain: what a replica does between SIGTERM and its exit (a rollout, a scale-down).

1. At the signal, `/ready` answers 503 and every new request but the probes and /metrics gets
   503 `shutting_down` with `Retry-After` (`DrainGate`), so the Service and the endpoint picker
   stop sending here and a client or gateway retries elsewhere. `/health` stays 200: the
   replica is alive, and a failing liveness probe would kill it mid-drain.
2. Requests in flight go on, for up to `http.drain_s`.
3. Whatever still runs then is cut (`cut`): a stream ends with the OpenAI error event
   (`shutting_down`) instead of a torn connection, a whole response is a 503. Only a stream whose
   client stopped reading (its send blocked) can still end without the event.
4. uvicorn closes its listeners and the app's lifespan stops the engine (serving.py).

A second signal cuts at once (step 3 now). Everything here runs on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from loraplex.adapters_registry.base import ErrorKind
from loraplex.server.errors import ApiError, error_response
from loraplex.server.metrics_access import METRICS_PATH, PICKER_METRICS_PATH

# Retry-After on a draining replica's 503: a retry through the Gateway reaches another replica
# at once, and this one will not serve again.
RETRY_AFTER_S = 1
# After the cut, how long the cut requests get to write their error event and end.
CUT_GRACE_S = 5.0
# Paths served while draining: the probes and the scrapes.
_ALWAYS_SERVED = frozenset({"/health", "/ready", METRICS_PATH, PICKER_METRICS_PATH})


class ShuttingDown(ApiError):
    kind = ErrorKind.UNAVAILABLE
    code = "shutting_down"

    def __init__(self) -> None:
        super().__init__(
            "The server is shutting down; retry the request.",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class Drain:
    """The drain's state: in-flight requests, and the tasks a cut cancels."""

    def __init__(self, drain_s: float) -> None:
        self.drain_s = drain_s
        self.draining = False
        self._in_flight = 0
        self._cut_done = False
        self._cuttable: set[asyncio.Task[Any]] = set()
        self._cut: set[asyncio.Task[Any]] = set()
        self._changed: asyncio.Event | None = None

    # ---- what requests call ----

    @contextmanager
    def request(self) -> Iterator[None]:
        """Count a request in flight for the block's length."""
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1
            self._notify()

    @contextmanager
    def cuttable(self, task: asyncio.Task[Any] | None = None) -> Iterator[None]:
        """Let the cut cancel `task` (the current one by default) while the block runs; catch
        the cancellation with `was_cut`. Entered after the cut, it cancels at once."""
        task = task or asyncio.current_task()
        assert task is not None
        self._cuttable.add(task)
        if self._cut_done:
            self._cancel(task)
        try:
            yield
        finally:
            self._cuttable.discard(task)

    def was_cut(self, task: asyncio.Task[Any] | None = None) -> bool:
        """Whether `task`'s (the current one's) cancellation is the drain's cut. Once asked
        about the current task, it is no longer cancelling: it goes on to end its response."""
        current = task is None
        task = task or asyncio.current_task()
        if task not in self._cut:
            return False
        self._cut.discard(task)
        if current and task is not None:
            task.uncancel()
        return True

    # ---- what the server calls ----

    def begin(self) -> None:
        self.draining = True
        self._notify()

    def cut(self) -> None:
        """Cancel every cuttable request now (step 3)."""
        self._cut_done = True
        for task in list(self._cuttable):
            self._cancel(task)

    def _cancel(self, task: asyncio.Task[Any]) -> None:
        if task not in self._cut and not task.done():
            self._cut.add(task)
            task.cancel("drain: http.drain_s passed")

    async def run(self) -> None:
        """Wait for the requests in flight to end, up to drain_s; cut the rest and give them
        CUT_GRACE_S to end."""
        self.begin()
        if not await self._idle_within(self.drain_s):
            self.cut()
            await self._idle_within(CUT_GRACE_S)

    async def _idle_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self._in_flight:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return False
        return True

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()


class DrainGate:
    """ASGI middleware: counts requests in flight, and answers new ones 503 while draining."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _ALWAYS_SERVED:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await error_response(ShuttingDown())(scope, receive, send)
            return
        with self.drain.request():
            await self.app(scope, receive, send)
