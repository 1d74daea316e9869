"""OpenAI request bodies: which fields loraplex serves, with every bound stated once so errors can
name it.

Unknown fields are refused (OpenAI answers "Unrecognized request argument supplied"), so a typo in a
sampling field never silently samples with defaults, and so are vLLM's fields that would let a
client choose what tenancy decides (`priority`, `cache_salt`, `request_id`, a chat template). The
OpenAI fields and vLLM extensions listed here are passed to vLLM's own request model
(`vllm_requests`), which checks their meaning (tool choice against the tools, response formats,
structured outputs); this module checks shapes and sizes, messages above all.

Each bound below keeps a value out of reach of something that would choke on it: integers beyond
64 bits fail vLLM's msgpack transport to the engine core (`top_k` 2**64 was a 500), `top_k` lives
in an int32 tensor of vLLM's batch, and every list or string that the gateway or vLLM walks per
request or per token is bounded so a body cannot buy unbounded work with its 8 MiB. Floats are
compared against their bounds, so NaN and infinities fail them. A token-id prompt is bounded by
the context (`MAX_PROMPT_TOKENS_KEY` in the validation context, set by `request_body`), and JSON
nesting by pydantic's parser (a recursion limit of a few hundred levels: a 400, never a 500).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

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
# vLLM's default max_logprobs (the engine refuses more).
MAX_PROMPT_LOGPROBS = 20
# OpenAI's own limit on `messages`. The gateway renders and pickles each message (a body parsed
# off the event loop comes back as one object per message: 8.5 ms for 2048).
MAX_MESSAGES = 2048
# Batched prompts of one /v1/completions request: each is an engine request of its own.
MAX_PROMPTS = 16
# OpenAI's limit on `tools`.
MAX_TOOLS = 128
# Entries of `logit_bias` and `stop_token_ids`: the sampler looks at each every step.
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64
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
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Name
    arguments: str


class ToolCall(BaseModel):
    """A tool call the assistant made, sent back in the conversation."""

    model_config = ConfigDict(extra="forbid")
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    # Reaches the chat template, as with vLLM (a template may show who speaks).
    name: Name | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Name | None = None  # a tool's answer: the call it answers
    reasoning: str | None = None  # an assistant turn's reasoning, for templates that show it

    @field_validator("content")
    @classmethod
    def _join_parts(cls, content: str | list[TextPart] | None) -> str | None:
        """Text parts are one text to the template: joined once, so a parsed request carries
        one string per message however many parts it had."""
        if content is None or isinstance(content, str):
            return content
        return "".join(part.text for part in content)

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                "`content` is required, except in an assistant message with `tool_calls`"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("`tool_calls` is only allowed in an assistant message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs `tool_call_id`, the call it answers")
        return self


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
    # Constrained decoding, by vLLM's structured-output backend.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    # vLLM extensions.
    ignore_eos: bool = False
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKEN_COUNT)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_PROMPT_LOGPROBS)

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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tool calling, parsed by vLLM's tool parser (engine.tool_call_parser).
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Chat-template and reasoning extensions of vLLM.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    include_reasoning: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    @field_validator("tools")
    @classmethod
    def _empty_tools_are_none(
        cls, tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]] | None:
        # OpenAI clients send `tools: []` for "no tools"; vLLM refuses an empty list.
        return tools or None

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
        cls, prompt: str | list[str] | list[int] | list[list[int]], info: ValidationInfo
    ) -> str | list[str] | list[int] | list[list[int]]:
        """Batched prompts are bounded in number; a token id is a TokenId (vLLM's renderer
        reads a negative one before any vocabulary check; the engine checks the vocabulary); a
        token-id prompt longer than the context cannot fit: refused where it is parsed, so the
        list never travels further (the context comes with the validation's context)."""
        if isinstance(prompt, list) and not prompt:
            raise ValueError("`prompt` must not be an empty list")
        batched = isinstance(prompt, list) and isinstance(prompt[0], str | list)
        if batched and len(prompt) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request (got {len(prompt)})")
        limit = (info.context or {}).get(MAX_PROMPT_TOKENS_KEY)
        id_lists = cast(
            list[list[int]], [p for p in (prompt if batched else [prompt]) if isinstance(p, list)]
        )
        longest = max((len(p) for p in id_lists), default=0)
        if limit is not None and longest > limit:
            raise ValueError(
                f"the prompt has {longest} token ids; the context holds at most {limit}"
            )
        if any(not 0 <= t <= MAX_TOKEN_COUNT for ids in id_lists for t in ids):
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN_COUNT}]")
        return prompt


class TokenizeRequest(BaseModel):
    """/tokenize: a prompt, or messages through the chat template (vLLM's two forms)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        if self.prompt is not None and (self.tools or self.chat_template_kwargs):
            raise ValueError("`tools` and `chat_template_kwargs` go with `messages`")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, min_length=1, max_length=MAX_NAME_CHARS)
    tokens: list[TokenId]
