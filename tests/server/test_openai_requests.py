"""Request bodies on their way to vLLM's serving objects (pure logic, no engine): loraplex's
allowlist and bounds, vLLM's own request model behind them, and the models object vLLM asks
which names are adapters."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from loraplex.adapters_registry.base import AdapterNotFound
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from loraplex.server.vllm_errors import from_vllm_error
from loraplex.server.vllm_requests import to_vllm
from loraplex.server.vllm_serving import AdapterNames

MESSAGES = [{"role": "user", "content": "Hi", "name": "alice"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def test_a_chat_body_becomes_vllms_request_with_loraplexs_own_id() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChat,
    )

    first, second = (to_vllm(chat(tools=[TOOL], tool_choice="required")) for _ in range(2))
    assert isinstance(first, VllmChat) and first.request_id != second.request_id
    assert first.messages == MESSAGES  # names reach the chat template
    assert first.tools[0].function.name == "f" and first.tool_choice == "required"


def test_the_defaults_clients_send_are_no_tools_and_plain_text() -> None:
    request = to_vllm(chat(tools=[], tool_choice="none", response_format={"type": "text"}))
    assert request.tools is None and request.to_sampling_params(8, {}).structured_outputs is None


@pytest.mark.parametrize(
    "field",
    ["priority", "cache_salt", "request_id", "kv_transfer_params", "vllm_xargs", "chat_template",
     "use_beam_search", "suffix"],
)  # fmt: skip
def test_fields_loraplex_decides_or_does_not_serve_are_refused(field: str) -> None:
    body = {"model": "m", "prompt": "Hi", field: 1}
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    assert e.value.errors()[0]["loc"] == (field,)


def test_vllms_own_checks_are_400s_naming_the_field() -> None:
    unknown_tool = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(Exception) as e:
        to_vllm(chat(tools=[TOOL], tool_choice=unknown_tool))
    error = from_vllm_error(e.value)
    assert error is not None and error.status == 400 and error.param == "tool_choice"
    with pytest.raises(Exception) as e:
        to_vllm(chat(response_format={"type": "json_schema"}))
    error = from_vllm_error(e.value)
    assert error is not None and error.param == "response_format"
    # A shape vLLM's model refuses: a 400 through the same handler as loraplex's own fields.
    with pytest.raises(RequestValidationError) as shape:
        to_vllm(chat(tools=[{"type": "function"}]))
    assert shape.value.errors()[0]["loc"][:2] == ("tools", 0)


def test_tokenize_takes_one_form() -> None:
    prompt = TokenizeRequest.model_validate({"prompt": "hi"})
    assert to_vllm(prompt).prompt == "hi"
    assert to_vllm(TokenizeRequest.model_validate({"messages": MESSAGES})).messages == MESSAGES
    with pytest.raises(ValidationError, match="exactly one of `prompt` and `messages`"):
        TokenizeRequest.model_validate({"prompt": "hi", "messages": MESSAGES})


class Registry:
    """The one AdapterSource call AdapterNames makes."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def resolve(self, name: str) -> object:
        if name not in self.names:
            raise AdapterNotFound(f"no adapter {name}")
        return name


def test_vllm_sees_the_registrys_adapters_and_never_a_default_one() -> None:
    names = AdapterNames(Registry({"bot", "text"}))  # type: ignore[arg-type]
    assert "bot" in names and "base" not in names and 7 not in names
    assert names["bot"].lora_name == "bot"
    with pytest.raises(KeyError):
        names["base"]
    # vLLM attaches an adapter named like a content type ("text") to base requests by iterating.
    assert list(names.values()) == [] and len(names) == 0
