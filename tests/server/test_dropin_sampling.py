"""loraplex gives the same seeded samples as vLLM's own OpenAI server under the model's
generation_config.json (tests/support/dropin.py: its non-default temperature, top_k and top_p
apply to requests that leave them unset), both serving one Hub snapshot with the same engine
arguments.

vLLM's server runs first and alone, and loraplex's starts once it has stopped: on a 2-core
machine vLLM's server beside an idle loraplex engine (which keeps a core busy) missed its 300 s
start in a full-suite run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.loadgen.polling import wait_until
from bench.loadgen.server import answers_ready, free_port
from tests.support.dropin import ACME_KEY, HUB_ID, TEMPLATE, dropin_server, hub_snapshot, user

PROMPTS = [
    "Write a haiku about the sea.",
    "Name three fruits.",
    "What is 2 + 2?",
    "Describe Paris in one sentence.",
    "Give me a reason to learn Python.",
    "Tell me a fact about cats.",
    "Invent a name for a robot.",
    "What color is the sky?",
]


def sample(api: openai.OpenAI, prompt: str, **extra: Any) -> list[str]:
    """The reply's tokens (as their logprobs entries name them), seeded."""
    reply = api.chat.completions.create(
        model=HUB_ID, messages=user(prompt), max_tokens=24, seed=7, logprobs=True, **extra
    )
    return [t.token for t in reply.choices[0].logprobs.content or []]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return hub_snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def vllm_samples(
    snapshot: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[str]]:
    """PROMPTS' samples from vLLM's own OpenAI server on the snapshot, with the engine arguments
    loraplex's server runs (LoRA on, as loraplex always has it); the server is stopped before
    this returns."""
    _, model_dir = snapshot
    work = tmp_path_factory.mktemp("vllm")
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", HUB_ID, "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "64", "--seed", "0",
        "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "8", "--max-lora-rank", "16",
        "--chat-template", str(TEMPLATE),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    log = (work / "vllm.log").open("wb")
    process = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        tail = lambda: (work / "vllm.log").read_text(errors="replace")[-3000:]  # noqa: E731
        assert wait_until(lambda: answers_ready(url, process, tail, "/health"), 300, 1), tail()
        theirs = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        return {prompt: sample(theirs, prompt) for prompt in PROMPTS}
    finally:
        os.killpg(process.pid, 15)
        process.wait(60)
        log.close()


@pytest.fixture(scope="module")
def client(
    snapshot: tuple[Path, Path],
    vllm_samples: dict[str, list[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[openai.OpenAI]:
    """loraplex's server on the snapshot, started after vLLM's has stopped (`vllm_samples`)."""
    with dropin_server(snapshot, tmp_path_factory.mktemp("dropin")) as process:
        yield openai.OpenAI(base_url=process.base_url + "/v1", api_key=ACME_KEY, max_retries=0)


def test_same_seeded_samples_as_vllms_server_under_the_generation_config(
    client: openai.OpenAI, vllm_samples: dict[str, list[str]]
) -> None:
    for prompt, theirs in vllm_samples.items():
        tokens = sample(client, prompt)
        assert tokens and tokens == theirs, prompt
    # The defaults are the generation config's: vLLM's neutral sampling differs somewhere.
    neutral = {"temperature": 1.0, "top_p": 1.0, "extra_body": {"top_k": -1}}
    assert any(sample(client, p) != sample(client, p, **neutral) for p in PROMPTS)
