"""Waiting on a live process (a server starting, a gauge settling): one deadline loop for the
benchmarks' server start and every test that waits, not one loop per suite.

The deadline counts the time this machine ran, not the time it was frozen: a CI VM that stopped
for about 5.5 minutes while CLOCK_MONOTONIC went on made a server start that needed ~30 s of
running time miss its 300 s deadline (docs/bench.md). A sleep between two checks that overruns
by more than FREEZE_GAP_S is such a freeze, and pushes the deadline back by its length. Only the
sleeps are watched: a slow read() is the waited-on process's time and counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

FREEZE_GAP_S = 5.0  # far above a busy machine's scheduling delay, far below the freeze above


class Deadline:
    """`timeout` seconds from now, pushed back by every freeze seen in sleep()."""

    def __init__(self, timeout: float) -> None:
        self._end = time.monotonic() + timeout

    def expired(self) -> bool:
        return time.monotonic() > self._end

    def sleep(self, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        if (overrun := time.monotonic() - start - seconds) > FREEZE_GAP_S:
            self._end += overrun


def poll(read: Callable[[], T | None], timeout: float, interval: float = 0.2) -> T | None:
    """read()'s first answer that is not None, or None once `timeout` has passed. The clock is
    read before each read(), so the last read starts after the timeout: a wait that read the
    clock after read() gave up on an answer read 35 s into a 105 s wait that reached it only
    after the deadline."""
    deadline = Deadline(timeout)
    while True:
        expired = deadline.expired()
        if (answer := read()) is not None:
            return answer
        if expired:
            return None
        deadline.sleep(interval)


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    """Whether check() came true before `timeout` passed (polled as `poll` polls)."""
    return poll(lambda: True if check() else None, timeout, interval) is not None
