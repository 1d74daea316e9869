"""Request -> prompt token ids, and the context-length check that must happen before the engine."""

from __future__ import annotations

from typing import Any

from loraplex.server.errors import ContextLengthExceeded, InvalidRequest
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def chat_prompt_ids(tokenizer: Any, request: ChatCompletionRequest) -> list[int]:
    """Messages through the model's own chat template, ending with the assistant's turn."""
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja errors from a template that rejects a role order, etc.
        raise InvalidRequest(
            f"`messages`: the chat template rejected them: {e}", param="messages"
        ) from e
    # The template already wrote the special tokens (BOS etc.); do not add them twice.
    return list(tokenizer.encode(text, add_special_tokens=False))


def completion_prompt_ids(tokenizer: Any, request: CompletionRequest) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    first = prompt[0]
    if isinstance(first, str):
        return list(tokenizer.encode(first))
    ids = [int(t) for t in (first if isinstance(first, list) else prompt)]  # type: ignore[arg-type]
    vocab = len(tokenizer)
    if any(t < 0 or t >= vocab for t in ids):
        raise InvalidRequest(f"`prompt`: token ids must be in [0, {vocab})", param="prompt")
    return ids


def output_budget(
    request: ChatCompletionRequest | CompletionRequest, prompt_len: int, max_model_len: int
) -> int:
    """Tokens the request may generate; 400 if prompt plus requested output exceed the context."""
    param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if prompt_len == 0:
        raise InvalidRequest(f"`{param}` is empty after tokenization", param=param)
    room = max_model_len - prompt_len
    if room < 1:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens; your `{param}` has "
            f"{prompt_len} tokens. Shorten it.",
            param=param,
        )
    requested = request.output_limit
    if requested is None:
        default = COMPLETIONS_DEFAULT_MAX_TOKENS if isinstance(request, CompletionRequest) else room
        return min(default, room)
    if requested > room:
        field = "max_tokens"
        if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens:
            field = "max_completion_tokens"
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the {param}, {requested} "
            f"for the completion). Reduce `{field}` to at most {room}.",
            param=field,
        )
    return requested
