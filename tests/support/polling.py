"""Waiting on a live process from a test: one deadline loop, not one per suite."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(read: Callable[[], T | None], timeout: float, interval: float = 0.2) -> T | None:
    """read()'s first answer that is not None, or None once `timeout` has passed. The clock is
    read before each read(), so the last read starts after the timeout: in CI (2026-11-22) an
    answer read 35 s into a 105 s wait reached the test only after the deadline, and a wait that
    read the clock after read() gave up on that stale answer."""
    deadline = time.monotonic() + timeout
    while True:
        expired = time.monotonic() > deadline
        if (answer := read()) is not None:
            return answer
        if expired:
            return None
        time.sleep(interval)


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    """Whether check() came true before `timeout` passed (polled as `poll` polls)."""
    return poll(lambda: True if check() else None, timeout, interval) is not None
