"""An adapter served by loraplex computes what PEFT computes: the same greedy tokens as the base
model with the adapter merged through transformers + PEFT (compared as the text of the first 10
tokens, which implies the first 8 agree) for several prompts; and each adapter's output differs
from the base model's."""

from __future__ import annotations

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.loadgen.server import ServerProcess
from loraplex.server.settings import default_cache_dir

CACHE = default_cache_dir()  # where the server finds the demo model, as it does
MODEL_DIR = CACHE / "models" / "SmolLM2-135M-Instruct"
PROMPTS = [
    "Write a haiku about the sea.",
    "List three fruits.",
    "Explain gravity in one sentence.",
    "What should I cook tonight?",
]
NEW_TOKENS = 10


def _prompt_ids(tokenizer: AutoTokenizer, question: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            return_dict=True,
        )["input_ids"]
    )


def _reference_tokens(adapter: str | None, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, CACHE / "demo-adapters" / adapter)
        model = model.merge_and_unload()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def _served_texts(url: str, model: str, prompts: list[list[int]]) -> list[str]:
    """Greedy completions from loraplex for prompts given as token ids (no re-tokenization)."""
    texts = []
    for ids in prompts:
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={
                "model": model,
                "prompt": ids,
                "max_tokens": NEW_TOKENS,
                "min_tokens": NEW_TOKENS,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


@pytest.mark.parametrize("adapter", ["demo-attn", "demo-mlp"])
def test_adapter_greedy_tokens_match_peft(embedded_server: ServerProcess, adapter: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    prompts = [_prompt_ids(tokenizer, q) for q in PROMPTS]
    expected = [tokenizer.decode(t) for t in _reference_tokens(adapter, prompts)]
    served = _served_texts(embedded_server.base_url, adapter, prompts)
    for want, got in zip(expected, served, strict=True):
        assert got == want, f"{adapter} diverged from PEFT: {got!r} vs {want!r}"
    base = _served_texts(embedded_server.base_url, "SmolLM2-135M-Instruct", prompts)
    assert base != served, f"{adapter} serves exactly the base model's text"
