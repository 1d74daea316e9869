"""`prompts.encode_within`: a fast tokenizer's Rust backend counts a prompt's tokens before any
becomes a Python int, with the same ids `tokenizer.encode` gives, and a prompt that leaves no room
in the context is a 400 `context_length_exceeded` naming its field. The demo model's tokenizer
as vLLM caches it (what the gateway tokenizes with); no engine.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from loraplex.server.errors import ContextLengthExceeded
from loraplex.server.prompts import encode_within
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_MODEL_LEN = 2048
CHAT = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
TEXT = CompletionRequest(model="m", prompt="hi")

random.seed(0)
TEXTS = [
    "Hello, world! Tell me a long story.",
    "<|im_start|>user\nhi<|im_end|>\n",  # special tokens written out, as a chat template does
    "".join(chr(random.randint(0x4E00, 0x9FFF)) for _ in range(200)),  # CJK
    "caf\u00e9 \U0001f600 na\u00efve \u00a0\t\n  spaces",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer

    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    return get_cached_tokenizer(AutoTokenizer.from_pretrained(ensure_demo_model(
        default_cache_dir())))  # fmt: skip


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("text", TEXTS, ids=["words", "specials", "cjk", "mixed", "empty"])
def test_same_ids_as_the_tokenizers_encode(tokenizer: Any, text: str, special: bool) -> None:
    assert tokenizer.backend_tokenizer is not None  # the path under test: the fast backend
    ids = encode_within(tokenizer, TEXT, text, MAX_MODEL_LEN, add_special_tokens=special)
    assert ids == tokenizer.encode(text, add_special_tokens=special)
    assert all(type(i) is int for i in ids)


@pytest.mark.parametrize(("request_", "param"), [(CHAT, "messages"), (TEXT, "prompt")])
def test_a_prompt_that_fills_the_context_is_a_400_naming_its_field(
    tokenizer: Any, request_: ChatCompletionRequest | CompletionRequest, param: str
) -> None:
    """CJK characters make several tokens each: well under the character bound, past the context."""
    text = "".join(chr(random.randint(0x4E00, 0x9FFF)) for _ in range(MAX_MODEL_LEN))
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert tokens >= MAX_MODEL_LEN
    with pytest.raises(ContextLengthExceeded) as caught:
        encode_within(tokenizer, request_, text, MAX_MODEL_LEN, add_special_tokens=False)
    assert caught.value.param == param
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in caught.value.message
    assert f"`{param}` has {tokens} tokens" in caught.value.message


def test_a_prompt_one_token_short_of_the_context_fits(tokenizer: Any) -> None:
    text = "lorem ipsum " * MAX_MODEL_LEN
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = tokenizer.decode(ids[: MAX_MODEL_LEN - 1])
    expected = tokenizer.encode(cut, add_special_tokens=False)
    assert len(expected) == MAX_MODEL_LEN - 1
    assert encode_within(tokenizer, TEXT, cut, MAX_MODEL_LEN, add_special_tokens=False) == expected


class _SlowTokenizer:
    """A tokenizer without a Rust backend (what `backend_tokenizer` marks): its own encode."""

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return [len(text), int(add_special_tokens)]


def test_other_tokenizers_keep_their_own_encode() -> None:
    ids = encode_within(_SlowTokenizer(), TEXT, "abc", MAX_MODEL_LEN, add_special_tokens=True)
    assert ids == [3, 1]
