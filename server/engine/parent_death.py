"""The processes the server starts die with it, even when it is killed with SIGKILL.

After `kill -9` of the server, vLLM's engine core and worker went on running (130% CPU, 4.8 GB),
since nothing tells a child that its parent died. Linux does, if the child asks:
`prctl(PR_SET_PDEATHSIG, SIGKILL)` has the kernel kill it when its parent exits. vLLM calls every
`vllm.general_plugins` entry point in each process it starts (engine core, workers), so this
module's `register` is one (pyproject.toml) and asks there; the gateway's own worker processes
call `die_with_parent` as their initializer.

The signal follows the thread that started the child, not the whole parent process: children
must be started from a thread that lives as long as the parent (the event loop's, for the
engine core and the gateway's workers; the engine core's main thread, for vLLM's workers).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process once its parent exits; if the parent already has
    (the request would never fire), die now. A no-op outside Linux."""
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGKILL)


def register() -> None:
    """vLLM's plugin hook. It also runs in the server's own process (vLLM loads plugins there
    too), which must outlive whatever started it: only processes started through
    multiprocessing, as vLLM starts its engine core and workers, ask to die with their parent."""
    if multiprocessing.parent_process() is not None:
        die_with_parent()
