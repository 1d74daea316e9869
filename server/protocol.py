"""OpenAI request bodies, with every bound stated once so errors can name it.

Unknown fields are refused (OpenAI answers "Unrecognized request argument supplied"), so a typo in a
sampling field never silently samples with defaults. A few vLLM extensions that benchmark clients
send (`ignore_eos`, `top_k`, `min_tokens`, `repetition_penalty`) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_N = 16
MAX_STOP_SEQUENCES = 4
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


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
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions used by benchmark clients.
    ignore_eos: bool = False
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
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
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
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
    prompt: str | list[str] | list[int] | list[list[int]]
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

    @model_validator(mode="after")
    def _check_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("`echo` is not supported")
        return self
