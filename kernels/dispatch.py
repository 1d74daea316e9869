"""Which form of our kernels serves a call: the batch sizes where the choice changes, in one table.

Sizes count tokens (dense LoRA) or routed (token, expert) pairs (MoE LoRA: tokens x top_k). A
form here is a way of running the same op (the same numbers, the references say which), so a
field moves time, never results. Each field's number was measured on the H200; the rows and the
forms that lost are in docs/kernels.md ("Dispatch"). tests/kernels/test_dispatch.py holds the
form each (tokens, pairs) point takes.

Who asks: the vLLM plugin (`kernels/vllm/`: dense kernel, align op, routing form and block, the
side stream), the MoE-LoRA op (PDL) and the tuner (`bench/kernels/tune_moe_lora.py`: which
candidates a batch gets).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Regimes:
    """The thresholds; REGIMES holds the ones in use (tests replace fields)."""

    # Dense LoRA: our GEMVs (a program per token) up to this many tokens, our tiled kernels above:
    # decode batches, which vLLM captures in graphs up to max_num_seqs (not timed at the bound).
    dense_gemv_max_tokens: int = 64
    # The sorted form's align: vLLM's op below this many pairs, ours from it (Qwen3, vLLM's against
    # ours: 512 pairs 9.8 vs 13.2 us, 2,048 pairs 16.4 vs 15.1, 131,072 pairs 497 vs 45).
    align_min_pairs: int = 2048
    # The naive form (no align, a program per pair) while pairs <= this x experts x max_loras,
    # where vLLM sorts from an eighth of it (GPT-OSS gate/up, naive against sorted: at the bound,
    # 256 pairs, 44.0 vs 48.5 us; at 512 pairs 74.0 vs 57.3).
    naive_pairs_per_slot_expert: int = 1
    # ... and at most this many pairs: the largest batch measured naive (Qwen3 1,024 pairs gate/up
    # 78.9 us naive against 81.6 sorted).
    naive_max_pairs: int = 1024
    # Where the batch's adapter count is known (vLLM's specialize_active_lora), also at most this
    # many pairs per (active adapter, expert): one adapter on every token re-reads its weights per
    # pair (Qwen3 at 128 tokens, a layer's LoRA: 58.2 us sorted against 100.2 naive).
    naive_pairs_per_active_slot_expert: int = 4
    # Sorted blocks of (at most this many pairs per slot-expert on average, BLOCK_M), never larger
    # than vLLM's own block: sparse groups are mostly padding rows at vLLM's 64 or 128 (Qwen3 at
    # 1,024 tokens gate/up: 166.4 us in blocks of 128, 108.7 in 16).
    small_blocks: tuple[tuple[int, int], ...] = ((8, 16), (16, 32), (32, 64))
    # Prefill sizes start here (vLLM 0.26 captures decode graphs up to 512 tokens, 4,096 pairs at
    # top-8): PDL through it and not past it (at 204,800 pairs PDL cost 2-8%), the MoE LoRA beside
    # the base GEMMs from it (the fork's host work pays off there: prefill 0.4381 -> 0.4327 s;
    # below it, CUDA graphs included, in order on the main stream: GPT-OSS decode 181.26 ->
    # 211.32 tok/s per request with the dense LoRA in one launch, docs/kernels.md), and the
    # tuner's prefill candidates from it.
    prefill_min_pairs: int = 8192

    def dense_gemv(self, tokens: int) -> bool:
        """Whether a dense LoRA call of `tokens` tokens takes our GEMVs (else our tiled kernels)."""
        return tokens <= self.dense_gemv_max_tokens

    def our_align(self, pairs: int) -> bool:
        """Whether our align kernels build the sorted form of `pairs` pairs (else vLLM's op)."""
        return pairs >= self.align_min_pairs

    def naive(
        self,
        pairs: int,
        experts: int,
        max_loras: int,
        vllm_naive: bool,
        active_loras: int | None = None,
    ) -> bool:
        """Whether a MoE-LoRA call runs in the naive routing form: where vLLM's own rule says so
        (`vllm_naive`), and while the pairs fit the bounds above, those per active adapter too
        where the batch's adapter count is known."""
        dense = pairs > self.naive_pairs_per_slot_expert * experts * max_loras
        crowded = (
            active_loras is not None
            and pairs > self.naive_pairs_per_active_slot_expert * experts * active_loras
        )
        return vllm_naive or (pairs <= self.naive_max_pairs and not dense and not crowded)

    def block_m(self, pairs: int, experts: int, max_loras: int, vllm_block_m: int) -> int:
        """The sorted form's block size: `small_blocks`' where the pairs are sparse enough, never
        larger than vLLM's `vllm_block_m`."""
        for most, block in self.small_blocks:
            if pairs <= most * experts * max_loras:
                return min(block, vllm_block_m)
        return vllm_block_m

    def pdl(self, pairs: int) -> bool:
        """Whether the op's kernels launch under Programmatic Dependent Launch: decode sizes and
        the first prefill size. Past it the expand's grid is far larger than the GPU, and its
        programs that launch early hold SM slots the shrink needs."""
        return pairs <= self.prefill_min_pairs

    def side_stream(self, pairs: int) -> bool:
        """Whether the MoE LoRA of `pairs` pairs goes on the side stream beside the base GEMMs:
        prefill sizes, where the fork's host work is paid back."""
        return pairs >= self.prefill_min_pairs

    def prefill(self, pairs: int) -> bool:
        """Whether a batch of `pairs` pairs is a prefill (the tuner's candidates differ)."""
        return pairs >= self.prefill_min_pairs


REGIMES = Regimes()
