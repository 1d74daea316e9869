"""The engine-path guard: a request whose logits are not finite fails, alone, before any of its
non-finite output reaches the client.

Detection is vLLM's own: asked for `logprobs` (0 = the sampled token's only), vLLM computes the
sampled token's log-probability from the raw logits of the request's row (`logprobs_mode`
`raw_logprobs`, vLLM's default, before temperature, penalties or masks) and returns it with
each token. A row holding a NaN or +inf gives NaN there, as does a row of -inf only
(log-softmax's sum is NaN, or inf - inf), while the token sampled from a finite row always has a
finite logprob (-inf entries beside finite ones give -inf only to tokens never sampled). Hidden
states that stop being finite reach the logits of that step (the last position's) or, through
the KV cache, of the next. The guard asks every request for logprob 0 where its client asked for
none, checks each output's new tokens before it is passed on, and hands the caller the output
without those logprobs, as if never asked. Its cost on decode: `python -m bench.isolation_cost`.

A failed request's engine request is aborted by the caller's generator (EngineClient.generate).
For an adapter's request the error names the adapter, and the gateway quarantines it
(generation.py); a base-model request only fails: nothing of the model is the client's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from loraplex.adapters_registry.base import ErrorKind, ServableAdapter
from loraplex.server.errors import ApiError

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams


class OutputNotFinite(ApiError):
    """The engine produced non-finite logits for this request; nothing non-finite was sent.
    503: the server's fault, and the next request is computed afresh."""

    kind = ErrorKind.UNAVAILABLE
    code = "non_finite_output"

    def __init__(self, choice: int, token: int, adapter: ServableAdapter | None = None) -> None:
        self.choice = choice
        self.token = token
        self.adapter = adapter
        super().__init__(self._message())

    @property
    def reason(self) -> str:
        """One line for logs and the quarantine record."""
        return f"non-finite logits at output token {self.token} of choice {self.choice}"

    def _message(self) -> str:
        return f"The model produced {self.reason}; the request was stopped."


class AdapterOutputNotFinite(OutputNotFinite):
    """Non-finite logits from an adapter's request: the adapter's values are the fault, and it
    is quarantined (422 `adapter_quarantined`, as every later request naming it gets: a client
    error that retrying will not fix)."""

    kind = ErrorKind.UNPROCESSABLE
    code = "adapter_quarantined"

    def __init__(self, choice: int, token: int, adapter: ServableAdapter) -> None:
        super().__init__(choice, token, adapter)
        self.adapter: ServableAdapter = adapter
        self.param = "model"

    def _message(self) -> str:
        assert self.adapter is not None
        return (
            f"The adapter `{self.adapter.name}` (version {self.adapter.version}) produced "
            f"{self.reason}; the request was stopped and the adapter is quarantined until an "
            "admin registers a new version, rolls it back or clears the quarantine."
        )


def engine_params(params: SamplingParams) -> SamplingParams:
    """`params` as the engine should get them: asking for the sampled token's logprob
    (logprobs=0) where `params` asks for none, and for logprobs in vLLM's flat form; a copy where
    that changes anything, else `params` itself.

    Flat (`flat_logprobs`, vLLM's own option): the front end keeps a request's logprobs in a few
    lists of numbers for its whole life, where the default is a dict of `Logprob` objects per
    token, each object one more for the garbage collector to scan while it holds the event loop.
    16 choices x 512 tokens x top_logprobs=20 made 172k of them and 257 collections (46 ms the
    longest on an empty heap); flat, none. Beside such a stream the gateway's loop stalled up to
    1.9 s, flat 216 ms (bench.stall n16_stream; docs/stalls.md). Positions still read as dicts,
    built when read."""
    if params.logprobs is not None and params.flat_logprobs:
        return params
    engine = params.clone()
    engine.flat_logprobs = True
    if engine.logprobs is None:
        engine.logprobs = 0
    return engine


def first_non_finite(output: RequestOutput) -> tuple[int, int] | None:
    """(choice index, token offset within this output) of the first new token whose sampled
    logprob is not finite, or None. Tokens without logprobs are not judged."""
    for choice in output.outputs:
        if choice.logprobs is None:
            continue
        positions = zip(choice.token_ids, choice.logprobs, strict=False)  # same length in vLLM
        for offset, (token_id, position) in enumerate(positions):
            sampled = position.get(token_id) if position is not None else None
            if sampled is not None and not math.isfinite(sampled.logprob):
                return choice.index, offset
    return None


class FiniteGuard:
    """One request's guard: `params` for the engine, then `check` on each output in order."""

    def __init__(self, params: SamplingParams, adapter: ServableAdapter | None) -> None:
        self.params = engine_params(params)
        self._adapter = adapter
        self._strip = params.logprobs is None
        self._emitted: dict[int, int] = {}  # choice index -> tokens already passed on

    def check(self, output: RequestOutput) -> RequestOutput:
        """`output`, without the logprobs its client did not ask for; raises OutputNotFinite
        (AdapterOutputNotFinite for an adapter) if a new token's logits were not finite."""
        if (bad := first_non_finite(output)) is not None:
            choice, offset = bad
            token = self._emitted.get(choice, 0) + offset
            if self._adapter is not None:
                raise AdapterOutputNotFinite(choice, token, self._adapter)
            raise OutputNotFinite(choice, token)
        for out in output.outputs:
            self._emitted[out.index] = self._emitted.get(out.index, 0) + len(out.token_ids)
            if self._strip:
                out.logprobs = None
                out.cumulative_logprob = None
        return output
