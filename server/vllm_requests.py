"""loraplex's validated request bodies -> vLLM's request objects, which vLLM's serving objects take.

The body was parsed and bounded against `protocol` (an allowlist: a field loraplex does not serve
is a 400 naming it). vLLM's own request model then checks what it knows (tool choice against the
tools, response formats, structured outputs, logprobs), and its failures are 400s in the same
envelope. Messages are not validated again: the union of message types vLLM declares costs a
validation per member type, and `protocol` already checked each message's shape.

vLLM's request id is loraplex's own: no client header or field chooses it.
"""

from __future__ import annotations

import functools
import uuid
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


@functools.cache
def _vllm_models() -> dict[type[BaseModel], type[BaseModel]]:
    """vLLM's request model for each of loraplex's, messages taken as already checked."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChat,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest as VllmCompletion,
    )
    from vllm.entrypoints.serve.tokenize.protocol import (
        DetokenizeRequest as VllmDetokenize,
    )
    from vllm.entrypoints.serve.tokenize.protocol import (
        TokenizeChatRequest as VllmTokenizeChat,
    )

    class Chat(VllmChat):
        messages: list[dict[str, Any]]  # type: ignore[assignment]

    class TokenizeChat(VllmTokenizeChat):
        messages: list[dict[str, Any]]  # type: ignore[assignment]

    return {
        ChatCompletionRequest: Chat,
        CompletionRequest: VllmCompletion,
        TokenizeRequest: TokenizeChat,
        DetokenizeRequest: VllmDetokenize,
    }


def _tokenize_prompt_model() -> type[BaseModel]:
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeCompletionRequest

    return TokenizeCompletionRequest


def to_vllm(body: BaseModel) -> Any:
    """vLLM's request object for `body`; raises RequestValidationError (a 400 naming the field)
    or vLLM's own validation error (VLLMValidationError, ValueError)."""
    data = body.model_dump(exclude_unset=True)
    model = _vllm_models()[type(body)]
    if isinstance(body, TokenizeRequest) and body.messages is None:
        model = _tokenize_prompt_model()
    if isinstance(body, ChatCompletionRequest | CompletionRequest):
        data["request_id"] = uuid.uuid4().hex
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from e
