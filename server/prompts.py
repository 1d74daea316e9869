"""Request -> prompt token ids, and the context-length checks that must happen before the engine.

Templating and tokenizing take time that grows with the prompt (an 8 MiB chat message took
5.5 s to tokenize, 2-core machine), so `generation` runs these functions in a thread pool, and
a prompt's characters are bounded by the context before any tokenizer sees them: a token covers
at most `tokenizer.max_chars_per_token` characters (vLLM's figure: the longest string in the
vocabulary, 81 for SmolLM2's byte-level BPE, one character per byte), so a text longer than
that many characters per token the context leaves the prompt cannot fit, whatever it says.
vLLM's own OpenAI server refuses such prompts the same way (`renderers/params.py`,
`_text_len_check`). The bound holds for tokenizers that drop no text before they split it
(byte-level BPE, SentencePiece); under it, tokenizing a prompt of ordinary words takes ~0.1 s
and one of CJK characters ~0.4 s (2-core machine), with the GIL released.
"""

from __future__ import annotations

from typing import Any

from loraplex.server.errors import ContextLengthExceeded, InvalidRequest
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest

# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def prompt_param(request: ChatCompletionRequest | CompletionRequest) -> str:
    return "messages" if isinstance(request, ChatCompletionRequest) else "prompt"


def prompt_char_bound(tokenizer: Any, max_model_len: int) -> int:
    """The most characters a prompt text can have and still fit: the context less one token for
    the output, times the tokenizer's longest token in characters. (The requested output is
    left to `output_budget`, which names `max_tokens` when that is what does not fit.)"""
    return (max_model_len - 1) * int(tokenizer.max_chars_per_token)


def check_prompt_chars(
    tokenizer: Any,
    request: ChatCompletionRequest | CompletionRequest,
    text: str,
    max_model_len: int,
) -> None:
    """400 `context_length_exceeded` for a text too long to fit in any tokenization."""
    bound = prompt_char_bound(tokenizer, max_model_len)
    if len(text) > bound:
        param = prompt_param(request)
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_model_len} tokens; your `{param}` has "
            f"{len(text)} characters, more than the {bound} that {max_model_len - 1} tokens can "
            f"hold (a token of this model holds at most {tokenizer.max_chars_per_token} "
            "characters). Shorten it.",
            param=param,
        )


def encode_within(
    tokenizer: Any,
    request: ChatCompletionRequest | CompletionRequest,
    text: str,
    max_model_len: int,
    *,
    add_special_tokens: bool,
) -> list[int]:
    """`text`'s token ids, or the 400 of a prompt that leaves no room in the context. A fast
    tokenizer's Rust backend counts the tokens before any becomes a Python int: under the
    character bound a prompt can still hold 443k tokens (CJK characters), whose conversion to a
    list held the GIL 81 ms, against 11 ms for the whole backend call (2-core machine)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # not a Hugging Face fast tokenizer: its own encode
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    (encoding,) = backend.encode_batch([text], add_special_tokens=add_special_tokens)
    if len(encoding) >= max_model_len:
        raise _no_room(prompt_param(request), len(encoding), max_model_len)
    return list(encoding.ids)


def _no_room(param: str, prompt_len: int, max_model_len: int) -> ContextLengthExceeded:
    return ContextLengthExceeded(
        f"This model's maximum context length is {max_model_len} tokens; your `{param}` has "
        f"{prompt_len} tokens. Shorten it.",
        param=param,
    )


def chat_prompt_ids(
    tokenizer: Any, request: ChatCompletionRequest, max_model_len: int
) -> list[int]:
    """Messages through the model's own chat template, ending with the assistant's turn."""
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # jinja errors from a template that rejects a role order, etc.
        raise InvalidRequest(
            f"`messages`: the chat template rejected them: {e}", param="messages"
        ) from e
    check_prompt_chars(tokenizer, request, text, max_model_len)
    # The template already wrote the special tokens (BOS etc.); do not add them twice.
    return encode_within(tokenizer, request, text, max_model_len, add_special_tokens=False)


def completion_prompt_ids(
    tokenizer: Any, request: CompletionRequest, max_model_len: int
) -> list[int]:
    prompt = request.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        check_prompt_chars(tokenizer, request, prompt, max_model_len)
        return encode_within(tokenizer, request, prompt, max_model_len, add_special_tokens=True)
    first = prompt[0]
    ids = [int(t) for t in (first if isinstance(first, list) else prompt)]  # type: ignore[arg-type]
    vocab = len(tokenizer)
    if any(t < 0 or t >= vocab for t in ids):
        raise InvalidRequest(f"`prompt`: token ids must be in [0, {vocab})", param="prompt")
    return ids


def output_budget(
    request: ChatCompletionRequest | CompletionRequest, prompt_len: int, max_model_len: int
) -> int:
    """Tokens the request may generate; 400 if prompt plus requested output exceed the context."""
    param = prompt_param(request)
    if prompt_len == 0:
        raise InvalidRequest(f"`{param}` is empty after tokenization", param=param)
    room = max_model_len - prompt_len
    if room < 1:
        raise _no_room(param, prompt_len, max_model_len)
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
