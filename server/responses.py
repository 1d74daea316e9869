"""OpenAI response bodies (whole and streamed chunks) built from vLLM's delta outputs.

`ChoiceState` accumulates one choice across deltas; the builders turn that state into the JSON the
OpenAI clients expect for chat (`chat.completion[.chunk]`) and text (`text_completion`) endpoints.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["chat", "text"]


# -inf (a token the sampler masked) is not JSON; OpenAI reports such tokens as -9999.
MIN_LOGPROB = -9999.0


def _logprob(logprob: Any) -> float:
    """A finite number in [MIN_LOGPROB, 0], whatever the engine computed: NaN (logits poisoned
    by a broken adapter) says no more than a masked token and is sent as MIN_LOGPROB, +inf as
    0 (no log-probability is above it). NaN and infinities are not JSON: a whole response
    holding one was a 500, a stream carried the bare word NaN."""
    value = float(logprob.logprob)
    if math.isnan(value):
        return MIN_LOGPROB
    return min(max(value, MIN_LOGPROB), 0.0)


def _ranked(position: dict[int, Any], top: int) -> list[tuple[int, Any]]:
    return sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top]


def _token_text(tokenizer: Any, token_id: int, logprob: Any) -> str:
    text = logprob.decoded_token
    return tokenizer.decode([token_id]) if text is None else str(text)


def _token_entry(tokenizer: Any, token_id: int, logprob: Any) -> dict[str, Any]:
    text = _token_text(tokenizer, token_id, logprob)
    return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode())}


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: Any, top: int) -> list[dict]:
    """`choices[i].logprobs.content` entries for the given tokens."""
    content = []
    for token_id, position in zip(token_ids, logprobs, strict=False):
        entry = _token_entry(tokenizer, token_id, position[token_id])
        entry["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in _ranked(position, top)]
        content.append(entry)
    return content


def text_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: Any, top: int, offset: int
) -> dict[str, list]:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, position in zip(token_ids, logprobs, strict=False):
        entry = _token_entry(tokenizer, token_id, position[token_id])
        out["tokens"].append(entry["token"])
        out["token_logprobs"].append(entry["logprob"])
        out["top_logprobs"].append(
            {_token_text(tokenizer, t, lp): _logprob(lp) for t, lp in _ranked(position, top)}
        )
        out["text_offset"].append(offset)
        offset += len(entry["token"])
    return out


@dataclass
class ChoiceState:
    index: int
    text: str = ""
    token_count: int = 0
    finish_reason: str | None = None
    logprobs: Any = None  # accumulated in the kind's wire format


@dataclass
class ResponseMeta:
    kind: Kind
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object_name(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(vllm_reason: str | None) -> str | None:
    """vLLM says stop, length or abort; OpenAI clients know stop and length."""
    if vllm_reason is None:
        return None
    return "length" if vllm_reason == "length" else "stop"


def whole_response(
    meta: ResponseMeta, choices: list[ChoiceState], prompt_tokens: int
) -> dict[str, Any]:
    body_choices = []
    for c in sorted(choices, key=lambda c: c.index):
        choice: dict[str, Any] = {"index": c.index, "finish_reason": c.finish_reason}
        if meta.kind == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
            choice["logprobs"] = {"content": c.logprobs} if c.logprobs is not None else None
        else:
            choice["text"] = c.text
            choice["logprobs"] = c.logprobs
        body_choices.append(choice)
    return {
        "id": meta.id,
        "object": meta.object_name,
        "created": meta.created,
        "model": meta.model,
        "choices": body_choices,
        "usage": usage(prompt_tokens, sum(c.token_count for c in choices)),
    }


def chunk(
    meta: ResponseMeta,
    index: int,
    text: str | None,
    finish: str | None,
    logprobs: Any = None,
    role: bool = False,
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "finish_reason": finish}
    if meta.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
        choice["logprobs"] = {"content": logprobs} if logprobs is not None else None
    else:
        choice["text"] = text or ""
        choice["logprobs"] = logprobs
    return {
        "id": meta.id,
        "object": meta.chunk_object_name,
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    }


def usage_chunk(meta: ResponseMeta, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": meta.id,
        "object": meta.chunk_object_name,
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage(prompt_tokens, completion_tokens),
    }
