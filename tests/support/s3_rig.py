"""moto's S3 server and the fault proxy in a process of their own, driven from the test over HTTP.

The registry's own tests run both as threads of the test process. The two-replica server tests
(`tests/server/test_admin_adapters.py`) instead stream from a real engine for minutes beside
them, and in two CI runs the in-process proxy stopped answering replica B: first with connect
timeouts for as long as the measured streams ran, then with 30 s read timeouts while the test's
own cold request reached B at least 50 s late. The test process itself was stalled; why was not
found (not open files: a local full run's test process held 20-30 files and 8-14 threads there).
Here a stall of the test process cannot stop S3, and if the rig stalls, `stacks()` asks it for
every thread's stack (faulthandler, on SIGUSR1).

    python -m tests.support.s3_rig   # prints {"endpoint": moto's URL, "proxy": the proxy's URL}
                                     # and serves until its stdin closes
"""

from __future__ import annotations

import faulthandler
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.loadgen.server import REPO
from tests.support.moto_s3 import moto_s3
from tests.support.s3_fault_proxy import CONTROL, FaultProxy, Forwarded, SlowBody

# A control call normally answers in milliseconds; a stalled proxy must not hang the test.
_CONTROL_TIMEOUT_S = 10.0


class S3Rig:
    """The process, and the same fault interface as an in-process `FaultProxy`."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.s3_rig"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=REPO,
            start_new_session=True,  # its own scheduling group (autogroup), not the test's
        )  # fmt: skip
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the S3 rig did not start:\n{self.log_tail()}")
        urls = json.loads(line)
        self.endpoint: str = urls["endpoint"]
        self.url: str = urls["proxy"]

    def _call(self, action: str, **args: Any) -> Any:
        r = httpx.post(self.url + CONTROL + action, json=args, timeout=_CONTROL_TIMEOUT_S)
        r.raise_for_status()
        return r.json()

    def fail(self, n: int, status: int = 500, code: str = "InternalError") -> None:
        self._call("fail", n=n, status=status, code=code)

    def reset(self, n: int) -> None:
        self._call("reset", n=n)

    def corrupt(self, n: int) -> None:
        self._call("corrupt", n=n)

    def slow(self, bytes_per_s: float | None) -> None:
        self._call("slow", bytes_per_s=bytes_per_s)

    def clear(self) -> None:
        self._call("clear")

    @property
    def hits(self) -> int:
        return int(self._call("state")["hits"])

    @property
    def slow_bodies(self) -> list[SlowBody]:
        return [SlowBody(**b) for b in self._call("state")["slow_bodies"]]

    @property
    def recent(self) -> list[Forwarded]:
        return [Forwarded(**r) for r in self._call("state")["recent"]]

    def stacks(self) -> str:
        """Every thread's stack in the rig process, from its log."""
        self._proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        return self.log_tail()

    def log_tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with moto_s3() as endpoint:
        proxy = FaultProxy("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
        print(json.dumps({"endpoint": endpoint, "proxy": proxy.url}), flush=True)
        sys.stdin.read()  # until the test closes our stdin (or dies)
        proxy.close()


if __name__ == "__main__":
    main()
