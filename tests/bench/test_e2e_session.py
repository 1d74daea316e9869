"""The e2e session's logic without a GPU: model shapes and their adapters (checked by loraplex's
registry and vLLM's own LoRA name parser), the streaming client's timing, the check's
comparisons, vLLM's start-up lines, and the summary's ratios."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.e2e.bench_e2e import (
    CHECK_BATCHES,
    NGRAM,
    agreement,
    check_label,
    compare,
    comparisons,
    speculative_config,
    stream_generate,
)
from bench.e2e.rows import (
    base_label,
    collect,
    offline_table,
    server_table,
    startup_split,
    summary,
)
from bench.e2e.serve_e2e import TINY, first_tokens, vllm_server_args
from bench.e2e.shapes import (
    ADAPTER_TARGETS,
    GPT_OSS_20B,
    RANK,
    SMALL_CHECK,
    adapter_config,
    adapter_shapes,
    build_once,
    dims,
    make_adapter,
    make_model,
    model_config,
    write_shape_only_checkpoint,
)
from bench.loadgen.client import Sample
from loraplex.adapters_registry.base_model import load_base_model_spec
from loraplex.adapters_registry.validation import validate_adapter


def test_gpt_oss_shape_is_the_published_20b_in_bf16() -> None:
    cfg = model_config("gpt-oss-20b")
    d = dims(cfg)
    assert (d.layers, d.hidden, d.inter, d.experts, d.q, d.kv) == (24, 2880, 2880, 32, 4096, 512)
    assert cfg["num_experts_per_tok"] == 4 and d.fused_experts
    assert "quantization_config" not in cfg  # bf16 experts, no mxfp4 method
    assert cfg["sliding_window"] == 128
    assert cfg["layer_types"][:4] == ["sliding_attention", "full_attention"] * 2
    assert len(model_config("gpt-oss-20b", layers=6)["layer_types"]) == 6


def test_transformers_reads_the_gpt_oss_config(tmp_path: Path) -> None:
    from transformers import AutoConfig

    make_model(tmp_path, "gpt-oss-20b")
    cfg: Any = AutoConfig.from_pretrained(tmp_path)
    assert type(cfg).__name__ == "GptOssConfig"
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.sliding_window) == (32, 4, 128)
    assert cfg.rope_parameters["rope_type"] == "yarn"
    assert cfg.rope_parameters["factor"] == GPT_OSS_20B["rope_scaling"]["factor"]


def test_gpt_oss_adapter_is_peft_target_parameters_layout() -> None:
    shapes = adapter_shapes(dims(model_config("gpt-oss-20b")))
    layer = "base_model.model.model.layers.0."
    re = RANK * 32
    assert shapes[layer + "mlp.experts.base_layer"] == ((re, 2880), (2 * 2880, re))  # gate_up
    assert shapes[layer + "mlp.experts"] == ((re, 2880), (2880, re))  # down
    assert shapes[layer + "self_attn.q_proj"] == ((RANK, 2880), (4096, RANK))
    assert shapes[layer + "self_attn.k_proj"] == ((RANK, 2880), (512, RANK))
    assert shapes[layer + "self_attn.o_proj"] == ((RANK, 4096), (2880, RANK))
    assert len(shapes) == 24 * 6
    config = adapter_config(dims(model_config("gpt-oss-20b")))
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_qwen_adapter_names_every_expert() -> None:
    shapes = adapter_shapes(dims(model_config("qwen3-30b-a3b", layers=2)))
    assert shapes["base_model.model.model.layers.1.mlp.experts.127.down_proj"] == (
        (RANK, 768), (2048, RANK),
    )  # fmt: skip
    assert len(shapes) == 2 * (4 + 3 * 128)
    assert adapter_shapes(SMALL_CHECK)[
        "base_model.model.model.layers.3.mlp.experts.31.gate_proj"
    ] == ((RANK, 512), (256, RANK))


@pytest.mark.parametrize("model", ["gpt-oss-20b", "qwen3-30b-a3b"])
def test_loraplex_validates_the_bench_adapter_against_the_shape_only_checkpoint(
    tmp_path: Path, model: str
) -> None:
    cfg = make_model(tmp_path / "model", model, 2, TINY[model])
    write_shape_only_checkpoint(tmp_path / "model", cfg)
    make_adapter(tmp_path / "lora", dims(cfg), seed=0)
    spec = load_base_model_spec(tmp_path / "model", model)
    validated = validate_adapter(tmp_path / "lora", spec, max_lora_rank=RANK,
                                 allowed_dtypes={"BF16"}, max_weight_abs=1e3)  # fmt: skip
    assert validated is not None


def test_vllm_maps_gpt_oss_adapter_names_to_its_modules() -> None:
    from vllm.lora.utils import parse_fine_tuned_lora_name
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    mapper = GptOssForCausalLM.hf_to_vllm_mapper
    layer = "base_model.model.model.layers.0."
    names = {
        parse_fine_tuned_lora_name(f"{layer}{m}.lora_A.weight", mapper)[0]
        for m in ("self_attn.q_proj", "mlp.experts.base_layer", "mlp.experts")
    }
    assert names == {"model.layers.0.attn.q_proj", "model.layers.0.mlp.experts.base_layer",
                     "model.layers.0.mlp.experts"}  # fmt: skip
    assert GptOssForCausalLM.is_3d_moe_weight


def test_vllms_lora_loader_takes_the_gpt_oss_adapter(tmp_path: Path) -> None:
    """vLLM's own loader (PEFT config checks, name mapping, unexpected-module check) on the
    bench's GPT-OSS adapter; expected modules are GptOss's LoRA layers (qkv_proj's packed
    slices, o_proj, the experts' 3D wrapper), as vLLM's worker derives them."""
    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    cfg = make_model(tmp_path / "model", "gpt-oss-20b", 2, TINY["gpt-oss-20b"])
    make_adapter(tmp_path / "lora", dims(cfg), seed=0)
    helper = PEFTHelper.from_local_dir(str(tmp_path / "lora"), None)
    lora = LoRAModel.from_local_checkpoint(
        str(tmp_path / "lora"), {"q_proj", "k_proj", "v_proj", "o_proj", "experts"}, helper,
        lora_model_id=1, device="cpu", dtype=torch.bfloat16,
        weights_mapper=GptOssForCausalLM.hf_to_vllm_mapper,
    )  # fmt: skip
    assert helper.r == RANK
    layer = "model.layers.1."
    want = {layer + m for m in ("attn.q_proj", "attn.o_proj", "mlp.experts.base_layer",
                                "mlp.experts")}  # fmt: skip
    assert want <= set(lora.loras)


def test_a_run_with_lora_targets_is_its_own_row_over_the_same_base() -> None:
    targeted = {**offline("plugin", "gpt-oss-20b", 95.0, 0.45),
                "lora_target_modules": list(ADAPTER_TARGETS)}  # fmt: skip
    both = {**targeted, "otps_per_req_median": 96.0, "variant": "dense_fused"}
    rows = [offline("base", "gpt-oss-20b", 100.0, 0.4), offline("plugin", "gpt-oss-20b", 90.0, 0.5),
            targeted, both]  # fmt: skip
    table = {t["mode"]: t for t in offline_table(rows)}
    assert table["plugin"]["vs_base"] == pytest.approx(0.9)
    assert table["plugin[targets=qkv_proj,o_proj,experts]"]["vs_base"] == pytest.approx(0.95)
    assert table["plugin[dense_fused;targets=qkv_proj,o_proj,experts]"]["vs_base"] == (
        pytest.approx(0.96)
    )


class FakeOutput:
    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.outputs = [type("Completion", (), {"token_ids": tokens})()]


class FakeEngine:
    """Streams one token per step to each request, the first after `prefill_steps` steps."""

    def __init__(self, prefill_steps: dict[int, int], length: int) -> None:
        self.prefill_steps, self.length = prefill_steps, length
        self.requests: dict[str, list[int]] = {}
        self.order: list[str] = []
        self.step_count = 0

    def add_request(self, rid: str, prompt: Any, params: Any, lora_request: Any = None) -> str:
        self.order.append(rid)
        self.requests[rid] = []
        return rid + "-internal"

    def has_unfinished_requests(self) -> bool:
        return any(len(t) < self.length for t in self.requests.values())

    def step(self) -> list[FakeOutput]:
        self.step_count += 1
        out = []
        for i, rid in enumerate(self.order):
            tokens = self.requests[rid]
            if self.step_count > self.prefill_steps[i] and len(tokens) < self.length:
                tokens.append(len(tokens))
                out.append(FakeOutput(rid, [tokens[-1]]))
        return out


def test_stream_generate_times_first_tokens_and_counts_steps() -> None:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = FakeEngine({0: 0, 1: 2}, length=3)
    llm = type("LLM", (), {"llm_engine": engine})()
    params = SamplingParams(max_tokens=3)
    streamed = stream_generate(llm, [{"prompt_token_ids": [1]}] * 2, params, None)
    assert streamed.tokens_per_request == [[0, 1, 2], [0, 1, 2]]
    assert streamed.steps == 5  # request 1's tokens come in steps 3-5
    assert streamed.ttft_s[0] < streamed.ttft_s[1]
    assert params.output_kind != RequestOutputKind.DELTA  # the caller's params are untouched


def check_row(tokens: list[list[int]], margin: float = 0.5) -> dict[str, Any]:
    return {"tokens": tokens, "margins": [[margin] * len(t) for t in tokens]}


def test_agreement_counts_base_requests_and_records_the_margin_at_a_flip() -> None:
    adapters: list[int | None] = [0, None, 1, None]
    ref = check_row([[1, 2], [3, 4], [5, 6], [7, 8]], 0.25)
    got = check_row([[1, 9], [3, 4], [5, 6], [7, 0]], 0.0)
    base = agreement(ref, got, adapters, base_only=True)
    assert (base["requests"], base["agree"]) == (2, 1)
    assert base["differences"] == [{"request": 3, "adapter": None, "position": 1,
                                    "reference_margin": 0.25, "margin": 0.0}]  # fmt: skip
    every = agreement(ref, got, adapters)
    assert (every["requests"], every["agree"]) == (4, 2)
    stopped = agreement(ref, check_row([[1, 2], [3], [5, 6], [7, 8]]), adapters)
    assert stopped["differences"][0]["position"] == 1  # an early stop is a difference


def test_comparisons_pair_each_run_with_its_references() -> None:
    labels = ["check-stock", "check-base", "check-plugin", "check-plugin-graphs",
              "check-base-graphs", "check-plugin-graphs-ngram", "check-plugin-draft",
              "check-stock-tp2", "check-plugin-graphs-tp2", "check-base-graphs-tp2"]  # fmt: skip
    pairs = set(comparisons(labels))
    assert pairs == {
        ("check-stock", "check-base", True),
        ("check-plugin", "check-stock", False), ("check-plugin", "check-base", True),
        ("check-plugin-graphs", "check-stock", False),
        ("check-plugin-graphs", "check-base-graphs", True),
        ("check-plugin-graphs-ngram", "check-plugin-graphs", False),
        ("check-plugin-draft", "check-plugin", False),
        ("check-plugin-graphs-tp2", "check-stock-tp2", False),
        ("check-plugin-graphs-tp2", "check-base-graphs-tp2", True),
    }  # fmt: skip
    assert check_label("check-plugin-graphs", 2, "ngram") == "check-plugin-graphs-tp2-ngram"
    assert check_label("check-plugin", 1, "draft") == "check-plugin-draft"


def test_speculation_is_a_method_vllm_knows(tmp_path: Path) -> None:
    """--spec draft: the check model at its path drafts for itself, under a method name vLLM's
    SpeculativeConfig takes; --spec ngram: NGRAM."""
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    draft = speculative_config("draft", tmp_path)
    assert draft["method"] in get_args(SpeculativeMethod)
    assert draft["model"] == str(tmp_path) and draft["num_speculative_tokens"] == 4
    assert speculative_config("ngram", tmp_path) == NGRAM


def test_check_batches_hold_eight_base_requests_beside_adapters() -> None:
    mixed = [b for b in CHECK_BATCHES.values() if None in b and any(a is not None for a in b)]
    assert sum(b.count(None) for b in mixed) >= 8


def test_compare_reads_the_runs_in_a_folder(tmp_path: Path) -> None:
    n = sum(len(b) for b in CHECK_BATCHES.values())
    same = [[1, 2]] * n
    for label in ("check-stock", "check-base", "check-plugin"):
        row = {**check_row(same), "step_timing": {"ms_per_step": 2.0}}
        (tmp_path / f"e2e_{label}.json").write_text(json.dumps(row))
    result = compare(tmp_path)
    assert result["kind"] == "check-compare"
    entry = result["agreement"]["check-plugin vs check-base (base)"]
    assert entry["requests"] == sum(b.count(None) for b in CHECK_BATCHES.values())
    assert entry["agree"] == entry["requests"]
    assert result["step_timing"]["check-plugin"] == {"ms_per_step": 2.0}


def test_step_times_compare_with_the_engine_without_lora_in_the_same_setting() -> None:
    assert base_label("check-plugin-graphs-tp2-ngram") == "check-base-graphs-tp2-ngram"
    assert base_label("check-stock") == "check-base"
    timing = {"ms_per_step": 3.0, "tokens_per_step": 20.0}
    row = {"kind": "check-compare", "agreement": {},
           "step_timing": {"check-plugin-graphs-ngram": timing,
                           "check-base-graphs-ngram": {**timing, "ms_per_step": 2.0}}}  # fmt: skip
    assert "STEP check-plugin-graphs-ngram: 3.00 ms/step (x1.500 of check-base-graphs-ngram)" in (
        "\n".join(summary([row]))
    )


LOG = """\
(EngineCore pid=1) INFO 11-28 08:00:01 [gpu_model_runner.py:5348] Model loading took 40.1 GiB memory and 12.500000 seconds
(Worker_TP1 pid=2) INFO [gpu_model_runner.py:5348] Model loading took 20.0 GiB memory and 14.250000 seconds
(EngineCore pid=1) INFO [backends.py:1156] Dynamo bytecode transform time: 9.81 s
(EngineCore pid=1) INFO [monitor.py:20] torch.compile took 61.20 s in total
(EngineCore pid=1) INFO [warm_up.py:77] loraplex MoE-LoRA kernels: LoRA warm-up of 6 prefill sizes (16..8192 tokens) and 3 logits row counts in 21.4 s
(EngineCore pid=1) INFO [gpu_model_runner.py:6845] Graph capturing finished in 17 secs, took 1.20 GiB
(EngineCore pid=1) INFO [core.py:348] init engine (profile, create kv cache, warmup model) took 120.33 s (compilation: 61.20 s)
"""  # noqa: E501


def test_startup_split_reads_vllms_lines_and_takes_the_slowest_worker() -> None:
    split = startup_split(LOG)
    assert split == {"weights_load_s": 14.25, "dynamo_s": 9.81, "compile_s": 61.2,
                     "lora_warm_up_s": 21.4, "cuda_graphs_s": 17.0, "engine_init_s": 120.33,
                     "compile_cache_hit": False}  # fmt: skip
    assert startup_split("")["compile_cache_hit"] is False


def offline(mode: str, model: str, otps: float, prefill: float) -> dict[str, Any]:
    return {"mode": mode, "model": model, "machine": "NVIDIA H200", "tp": 1,
            "otps_per_req_median": otps, "prefill_s_median": prefill, "ttft_p50_s": 0.5,
            "ttft_p90_s": 0.7, "startup_s": 100.0, "startup": {"compile_s": 50.0}}  # fmt: skip


def test_offline_ratios_are_per_model() -> None:
    rows = [offline("base", "gpt-oss-20b", 100.0, 0.4), offline("plugin", "gpt-oss-20b", 90.0, 0.5),
            offline("base", "qwen3-30b-a3b", 76.0, 0.4),
            offline("plugin", "qwen3-30b-a3b", 66.0, 0.44)]  # fmt: skip
    table = {(t["model"], t["mode"]): t for t in offline_table(rows)}
    assert table["gpt-oss-20b", "plugin"]["vs_base"] == pytest.approx(0.9)
    assert table["gpt-oss-20b", "plugin"]["prefill_vs_base"] == pytest.approx(1.25)
    assert table["qwen3-30b-a3b", "plugin"]["vs_base"] == pytest.approx(66 / 76)
    assert any("OFFLINE gpt-oss-20b plugin tp1: 90.000" in line for line in summary(rows))


def test_a_decode_variant_is_its_own_row_over_the_same_base() -> None:
    both = {**offline("plugin", "qwen3-30b-a3b", 69.0, 0.44), "variant": "dense_fused,moe_inline"}
    rows = [offline("base", "qwen3-30b-a3b", 76.0, 0.4),
            offline("plugin", "qwen3-30b-a3b", 66.0, 0.44), both]  # fmt: skip
    table = {t["mode"]: t for t in offline_table(rows)}
    assert table["plugin"]["vs_base"] == pytest.approx(66 / 76)
    assert table["plugin[dense_fused,moe_inline]"]["vs_base"] == pytest.approx(69 / 76)


def test_server_ratios_are_over_vllms_own_servers() -> None:
    def served(server: str, requests: str, tok_s: float, ttft: float) -> dict[str, Any]:
        return {"server": server, "requests": requests, "output_tok_s": tok_s,
                "ttft_p50_s": ttft, "model": "qwen3-30b-a3b", "gpu": "NVIDIA H200"}  # fmt: skip

    rows = [served("vllm-base", "base", 1000.0, 0.5), served("vllm-stock", "lora", 600.0, 0.7),
            served("plugin", "lora", 900.0, 0.55)]  # fmt: skip
    plugin = next(t for t in server_table(rows) if t["server"] == "plugin")
    assert plugin["vs_vllm_base"] == pytest.approx(0.9)
    assert plugin["vs_vllm_stock"] == pytest.approx(1.5)
    assert plugin["ttft_vs_vllm_base"] == pytest.approx(1.1)


def test_collect_takes_every_row_file_of_a_part(tmp_path: Path) -> None:
    (tmp_path / "e2e_base-qwen3-30b-a3b.json").write_text(json.dumps({"mode": "base"}, indent=1))
    (tmp_path / "e2e_serve_plugin-qwen3-30b-a3b.jsonl").write_text('{"server": "plugin"}\n' * 2)
    (tmp_path / "base-qwen.log").write_text("not a row")
    rows = collect(tmp_path, "a")
    assert rows == [{"mode": "base", "part": "a"}] + [{"server": "plugin", "part": "a"}] * 2


def test_vllm_server_gets_the_same_engine_and_lora_modules(tmp_path: Path) -> None:
    base = vllm_server_args("vllm-base", tmp_path / "m", tmp_path / "ads")
    assert "--enable-lora" not in base
    assert base[base.index("--load-format") + 1] == "dummy"
    stock = vllm_server_args("vllm-stock", tmp_path / "m", tmp_path / "ads")
    assert stock[stock.index("--max-lora-rank") + 1] == str(RANK)
    modules = stock[stock.index("--lora-modules") + 1 :]
    assert modules[0] == f"ad0={tmp_path / 'ads' / 'ad0'}" and len(modules) == 8


def test_build_once_moves_a_whole_folder_in_and_drops_a_late_copy(tmp_path: Path) -> None:
    target = tmp_path / "model"
    seen: list[Path] = []

    def build(folder: Path) -> None:
        assert folder != target and not (target / "w").exists()
        seen.append(folder)
        (folder / "w").write_text(str(len(seen)))
        if len(seen) == 1:  # another process finishes first, while this one builds
            build_once(target, "w", build)

    build_once(target, "w", build)
    assert (target / "w").read_text() == "2"  # the first to finish stays
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no half-built copies left
    build_once(target, "w", build)
    assert len(seen) == 2  # built already: nothing to do


def test_first_tokens_lists_each_request_in_the_order_sent() -> None:
    samples = [Sample(tenant="e2e", adapter=None, sent_at=10.5, ttft_s=0.4),
               Sample(tenant="e2e", adapter="ad0", sent_at=10.0, ttft_s=0.12345),
               Sample(tenant="e2e", adapter=None, sent_at=11.0, error="503")]  # fmt: skip
    assert first_tokens(samples) == [[0.0, 0.123], [0.5, 0.4], [1.0, None]]
    assert first_tokens([]) == []
