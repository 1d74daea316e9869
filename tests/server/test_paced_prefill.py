"""The paced-prefill scheduler, as vLLM's engine core runs it: vLLM's real `Scheduler` (the demo
model's config, a small KV cache), fed requests and finished steps by hand, as the engine core
does."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PACED = 8  # tokens per step for a paced request
PROMPT = 64


@pytest.fixture(scope="module")
def vllm_config():  # type: ignore[no-untyped-def]
    from vllm.engine.arg_utils import EngineArgs

    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    args = EngineArgs(
        model=str(ensure_demo_model(default_cache_dir())),
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=256,  # below the longest prompt below: light prompts chunk too
        scheduling_policy="priority",
        enable_prefix_caching=False,
    )
    return args.create_engine_config()


def make_scheduler(vllm_config, paced: bool):  # type: ignore[no-untyped-def]
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from loraplex.server.engine.builder import paced_prefill_scheduler
    from loraplex.server.engine.paced_prefill import PacedPrefillScheduler

    # As the builder configures the engine; vLLM's own scheduler runs with its defaults.
    pacing = paced_prefill_scheduler(PACED)["long_prefill_token_threshold"] if paced else 0
    vllm_config.scheduler_config.long_prefill_token_threshold = pacing
    block = 16
    vllm_config.cache_config.num_gpu_blocks = 1024
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=1024,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
    )
    cls = PacedPrefillScheduler if paced else Scheduler
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block,
    )


def request(rid: str, priority: int, prompt: int = PROMPT):  # type: ignore[no-untyped-def]
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=32, ignore_eos=True)
    return Request(rid, list(range(1, prompt + 1)), params, None, priority=priority)


def step(scheduler) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """One engine step: schedule, then report one sampled token for each request that finished
    its prompt (as the model runner would)."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = scheduler.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = scheduler.requests[rid]  # schedule() has already counted this step's tokens
        sampled.append([7] if r.num_computed_tokens >= r.num_tokens else [])
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={rid: i for i, rid in enumerate(ids)},
        sampled_token_ids=sampled,
    )
    scheduler.update_from_output(out, result)
    return dict(out.num_scheduled_tokens)


def test_a_paced_request_prefills_in_chunks_beside_the_decodes(vllm_config) -> None:  # type: ignore[no-untyped-def]
    scheduler = make_scheduler(vllm_config, paced=True)
    scheduler.add_request(request("b-first", priority=0))
    assert step(scheduler) == {"b-first": PROMPT}  # a light request: its whole prompt at once
    scheduler.add_request(request("a-backlogged", priority=2))
    steps = [step(scheduler) for _ in range(3)]
    assert [s["a-backlogged"] for s in steps] == [PACED] * 3
    assert all(s["b-first"] == 1 for s in steps)  # decodes go on beside the chunks


def test_one_paced_chunk_per_step_the_oldest_first(vllm_config) -> None:  # type: ignore[no-untyped-def]
    scheduler = make_scheduler(vllm_config, paced=True)
    scheduler.add_request(request("a-1", priority=1))
    assert step(scheduler) == {"a-1": PACED}  # paced even when alone in the engine
    scheduler.add_request(request("a-2", priority=2))
    chunks = [step(scheduler) for _ in range(PROMPT // PACED - 1)]
    assert chunks == [{"a-1": PACED}] * (PROMPT // PACED - 1)  # a-2 waits its turn
    assert step(scheduler) == {"a-1": 1, "a-2": PACED}  # a-1 decodes; a-2's turn


def test_a_light_prompt_goes_whole_in_a_step_the_paced_requests_sit_out(vllm_config) -> None:  # type: ignore[no-untyped-def]
    scheduler = make_scheduler(vllm_config, paced=True)
    scheduler.add_request(request("light-1", priority=0))
    scheduler.add_request(request("a-1", priority=1))
    step(scheduler)  # light-1 whole; a-1 waits
    for _ in range(PROMPT // PACED):
        step(scheduler)  # a-1's prompt, in chunks; now it decodes
    scheduler.add_request(request("a-2", priority=2))
    assert step(scheduler) == {"light-1": 1, "a-1": 1, "a-2": PACED}  # a-2 is mid-prompt
    scheduler.add_request(request("b-first", priority=0))
    scheduler.add_request(request("a-3", priority=3))
    # Light requests only: b's prompt and light-1's decode; a-1, a-2 and a-3 wait one step.
    assert step(scheduler) == {"light-1": 1, "b-first": PROMPT}
    assert step(scheduler) == {"light-1": 1, "a-1": 1, "a-2": PACED, "b-first": 1}


def test_with_every_request_light_it_schedules_as_vllm_does(vllm_config) -> None:  # type: ignore[no-untyped-def]
    """A tenant alone gets priority 0 on everything: the same steps as vLLM's own scheduler,
    prompts longer than a step's budget included."""
    runs = []
    for paced in (True, False):
        scheduler = make_scheduler(vllm_config, paced=paced)
        trace = []
        for i in range(6):
            scheduler.add_request(request(f"r{i}", priority=0, prompt=40 + 300 * (i % 2)))
            trace.append(step(scheduler))
            trace.append(step(scheduler))
        runs.append(trace)
    assert runs[0] == runs[1]
