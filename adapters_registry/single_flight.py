"""Single flight: concurrent callers asking for the same key share one execution.

50 requests for one cold adapter must cause one download and one engine load. The work runs as
its own task, shielded from the callers: a caller that is cancelled (client disconnect) stops
waiting but does not cancel the load the others are waiting on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SingleFlight(Generic[K, V]):
    def __init__(self) -> None:
        self._inflight: dict[K, asyncio.Task[V]] = {}

    def running(self, key: K) -> bool:
        return key in self._inflight

    async def do(self, key: K, work: Callable[[], Awaitable[V]]) -> V:
        """Run `work()` unless a run for `key` is already in flight; either way await its result."""
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(work())
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._done(key, t))
        return await asyncio.shield(task)

    def _done(self, key: K, task: asyncio.Task[V]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved here so an error nobody awaited is not logged as lost
