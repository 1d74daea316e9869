"""bench.streams_process: the stream processes' `decoding` / `stop` protocol, in a real child
process with pipes, as bench.soak and bench.stall drive bench.soak_streams and bench.stall_clock."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from bench.loadgen.server import REPO

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    from bench.streams_process import decode_until_stop

    async def stream(ticks):
        while True:
            ticks.append(1)
            await asyncio.sleep(0.01)

    async def failing():  # fails at its first turn, before the parent's `stop` is read
        raise RuntimeError("a stream failed")

    async def main():
        ticks = []
        tasks = [asyncio.create_task(stream(ticks))]
        if sys.argv[1] == "fail":
            tasks.append(asyncio.create_task(failing()))
        await decode_until_stop(tasks)
        print(f"stopped after {len(ticks)} ticks", flush=True)

    asyncio.run(main())
    """
)


def child(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", CHILD, mode], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip


def test_streams_run_until_stop_then_end_cancelled() -> None:
    proc = child("ok")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "decoding"
    out, err = proc.communicate("stop\n", timeout=30)
    assert proc.returncode == 0, err
    assert out.startswith("stopped after ") and int(out.split()[2]) >= 1


def test_a_failed_stream_ends_the_process_without_its_output() -> None:
    proc = child("fail")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "decoding"
    out, err = proc.communicate("stop\n", timeout=30)
    assert proc.returncode != 0
    assert out == "" and "RuntimeError: a stream failed" in err
