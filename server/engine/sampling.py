"""OpenAI sampling fields -> vLLM `SamplingParams` (always streamed as deltas)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from vllm import SamplingParams


def to_sampling_params(
    request: ChatCompletionRequest | CompletionRequest, max_tokens: int
) -> SamplingParams:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if isinstance(request, ChatCompletionRequest):
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    optional: dict[str, Any] = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "seed": request.seed,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "min_tokens": request.min_tokens,
        "stop": request.stop,
        "logprobs": logprobs,
    }
    return SamplingParams(
        n=request.n,
        max_tokens=max_tokens,
        ignore_eos=request.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        **{k: v for k, v in optional.items() if v is not None},
    )
