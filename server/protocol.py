"""OpenAI request bodies, with every bound stated once so errors can name it.

Unknown fields are refused (OpenAI answers "Unrecognized request argument supplied"), so a typo in a
sampling field never silently samples with defaults. A few vLLM extensions that benchmark clients
send (`ignore_eos`, `top_k`, `min_tokens`, `repetition_penalty`) are accepted.

Each bound below keeps a value out of reach of something that would choke on it: integers beyond
64 bits fail vLLM's msgpack transport to the engine core (`top_k` 2**64 was a 500), `top_k` lives
in an int32 tensor of vLLM's batch, and every list or string that the gateway or vLLM walks per
request or per token is bounded so a body cannot buy unbounded work with its 8 MiB. Floats are
compared against their bounds, so NaN and infinities fail them. A token-id prompt is bounded by
the context (`MAX_PROMPT_TOKENS_KEY` in the validation context, set by `request_body`), and JSON
nesting by pydantic's parser (a recursion limit of a few hundred levels: a 400, never a 500).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

MAX_N = 16
MAX_STOP_SEQUENCES = 4
# vLLM looks for every stop string after every token (its detokenizer searches the text's last
# len(stop) characters), in the gateway's own process: long ones cost every step of the request.
MAX_STOP_CHARS = 1024
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# OpenAI's own limit on `messages`. The gateway renders and pickles each message (a body parsed
# off the event loop comes back as one object per message: 8.5 ms for 2048).
MAX_MESSAGES = 2048
# Names and ids that are echoed in errors and logs, never prompts: an adapter name is at most 128
# characters (adapters_registry/names.py).
MAX_NAME_CHARS = 256
# A count of tokens: no context is longer, and vLLM keeps such counts in int32 tensors.
MAX_TOKEN_COUNT = 2**31 - 1
# `top_k` at or above the vocabulary's size means no top-k; vLLM stores it as int32.
MAX_TOP_K = 2**31 - 1
MAX_PROMPT_TOKENS_KEY = "max_prompt_tokens"

TokenCount = Annotated[int, Field(ge=1, le=MAX_TOKEN_COUNT)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: Name | None = None

    @field_validator("content")
    @classmethod
    def _join_parts(cls, content: str | list[TextPart]) -> str:
        """Text parts are one text to the template: joined once, so a parsed request carries
        one string per message however many parts it had."""
        return content if isinstance(content, str) else "".join(part.text for part in content)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    max_tokens: TokenCount | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Name | None = None
    # vLLM extensions used by benchmark clients.
    ignore_eos: bool = False
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKEN_COUNT)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences (got {len(stops)})")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        if longest := max((len(s) for s in stops if len(s) > MAX_STOP_CHARS), default=0):
            raise ValueError(
                f"stop sequences must be at most {MAX_STOP_CHARS} characters (got {longest})"
            )
        return stops

    @model_validator(mode="after")
    def _check_combinations(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` is only allowed when `stream` is true")
        if self.n > 1 and self.temperature == 0:
            raise ValueError("`n` must be 1 when `temperature` is 0 (greedy choices are identical)")
        limit = self.output_limit
        if self.min_tokens is not None and limit is not None and self.min_tokens > limit:
            raise ValueError(
                f"`min_tokens` ({self.min_tokens}) must be <= the output limit ({limit})"
            )
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("`top_logprobs` requires `logprobs` to be true")
        return self

    @property
    def output_limit(self) -> int | None:
        """`max_completion_tokens` supersedes the deprecated `max_tokens`."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    # Members tried in this order, strictly for ids (a list of digit strings stays text): the
    # default "smart" union tried every member and took 2.4 s over an 8 MiB id list, 0.5 s so.
    prompt: str | list[StrictInt] | list[list[StrictInt]] | list[str] = Field(
        union_mode="left_to_right"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _check_prompt(
        cls, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("`prompt` must not be an empty list")
        if isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list)):
            raise ValueError("batched prompts are not supported: send one prompt per request")
        return prompt

    @field_validator("prompt")
    @classmethod
    def _check_prompt_ids(
        cls, prompt: str | list[str] | list[int] | list[list[int]], info: ValidationInfo
    ) -> str | list[str] | list[int] | list[list[int]]:
        """A token-id prompt longer than the context cannot fit: refused where it is parsed, so
        the list never travels further (the context comes with the validation's context)."""
        limit = (info.context or {}).get(MAX_PROMPT_TOKENS_KEY)
        ids = prompt[0] if prompt and isinstance(prompt[0], list) else prompt
        if limit is not None and isinstance(ids, list) and len(ids) > limit:
            raise ValueError(
                f"the prompt has {len(ids)} token ids; the context holds at most {limit}"
            )
        return prompt

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("`echo` is not supported")
        return self
