"""What `EngineClient` reads of vLLM's AsyncLLM, faked for tests of the gateway's own logic
(the order of its steps, how a stream ends): a tokenizer and one step's output."""

from __future__ import annotations

import types


class Tokenizer:
    max_chars_per_token = 16  # what vLLM's cached tokenizers say; bounds a prompt's characters

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, 2, 3]


def output(last: bool) -> types.SimpleNamespace:
    """One step's RequestOutput: one token of one sequence, the last with finish_reason."""
    out = types.SimpleNamespace(
        index=0, token_ids=[5], text="x", logprobs=None, finish_reason="length" if last else None
    )
    return types.SimpleNamespace(finished=last, outputs=[out], prompt_logprobs=None)
