"""The protocol of the benchmarks' stream processes (bench.soak_streams, bench.stall_clock).

Steady streams are timed in a process of their own, so that the benchmark's own work does not
read as inter-token gaps. The parent starts it with pipes for stdin and stdout; it prints
`decoding` once every stream has its first token, runs until the parent writes `stop` on
stdin, then cancels its streams and prints one JSON object (what each module's docstring says).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence
from typing import Any


async def decode_until_stop(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Print `decoding`, wait for the parent's `stop` (a line on stdin, read in a thread so the
    streams go on), then cancel `tasks` and wait for each. An exception other than the
    cancellation propagates: a stream that failed ends the process without its JSON."""
    print("decoding", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
