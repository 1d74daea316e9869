"""The PunicaWrapperGPU methods' routing forms: what the wrapped align asks vLLM's for, and the
block the kernels then read."""

from __future__ import annotations

import dataclasses


class _Wrapper:
    """What `routing_for_our_kernels` reads of a PunicaWrapperGPU: its LoRA config and the
    step's count of active adapters (vLLM's default: max_loras + 1, as if unspecialized)."""

    def __init__(
        self, fully_sharded: bool, rank: int, active: int = 9, specialize: bool = False
    ) -> None:
        import torch

        fields = {
            "fully_sharded_loras": fully_sharded,
            "max_lora_rank": rank,
            "specialize_active_lora": specialize,
        }
        self.lora_config = type("LoRAConfig", (), fields)()
        count = torch.tensor([active], dtype=torch.int32)
        self.token_mapping_meta = type("LoRAKernelMeta", (), {"num_active_loras_cpu": count})()


@dataclasses.dataclass(frozen=True)
class _Asked:
    """What the wrapped align handed on to vLLM's, and what it returned."""

    naive: bool
    block: int
    routing: tuple
    punica: _Wrapper  # the stand-in wrapper the align ran on


def _routing_asked(
    pairs: int,
    experts: int = 32,
    slots: int = 8,
    block: int = 64,
    punica: _Wrapper | None = None,
    **call: object,
) -> _Asked:
    """The routing form the wrapped align asks vLLM's for, for a call of `pairs` (token, expert)
    pairs as vLLM's add_lora_w13 makes it with its config's block size `block`, under inference
    mode as in vLLM's forward. vLLM's method is a stand-in that returns its sorted ids (None in
    the naive form) as a tensor of its own."""
    import torch

    from loraplex.kernels.vllm.punica import routing_for_our_kernels

    seen = []

    def vllm_align(self: object, topk_ids: torch.Tensor, *args: object) -> tuple:
        seen.append(args)
        naive = args[7]
        return mapping, None if naive else torch.zeros(slots * 64), torch.zeros(slots), None

    wrapped = routing_for_our_kernels(vllm_align)
    rank = call.pop("rank", 32)
    assert isinstance(rank, int)
    wrapper = punica or _Wrapper(bool(call.pop("fully_sharded", False)), rank)
    topk_ids = torch.zeros(pairs // 4, 4, dtype=torch.int32)
    enabled, mapping = torch.ones(9), torch.zeros(pairs // 4)
    kwargs = {"expert_map": None, "naive_block_assignment": False} | call
    with torch.inference_mode():
        routing = wrapped(wrapper, topk_ids, pairs // 4, block, experts, slots, enabled,
                          pad_sorted_ids=True, token_lora_mapping=mapping, **kwargs)  # fmt: skip
    # Everything but the routing form reaches vLLM's method as given, and its result comes back.
    (args,) = seen
    assert args[0] == pairs // 4 and args[2:7] == (
        experts,
        slots,
        enabled,
        kwargs["expert_map"],
        True,
    )
    assert args[8] is mapping
    assert routing[0] is mapping
    return _Asked(bool(args[7]), int(args[1]), routing, wrapper)


def test_naive_routing_form_up_to_one_pair_per_slot_expert_on_average() -> None:
    """vLLM sorts GPT-OSS calls (32 experts, 8 slots) from 33 pairs; the plugin asks for the
    naive form while pairs <= experts x slots, and REGIMES.naive_max_pairs at most."""
    from loraplex.kernels.dispatch import REGIMES

    assert _routing_asked(64).naive
    assert _routing_asked(32 * 8).naive
    assert not _routing_asked(32 * 8 + 4).naive
    assert _routing_asked(32 * 8 + 4, naive_block_assignment=True).naive  # vLLM's own say
    assert _routing_asked(REGIMES.naive_max_pairs, experts=128).naive
    past_the_cap = REGIMES.naive_max_pairs + 4  # sparse at 256 experts, but past the cap
    assert not _routing_asked(past_the_cap, experts=256).naive


def test_sorted_blocks_of_16_32_then_64_while_the_pairs_are_sparse() -> None:
    """In the sorted form the plugin asks for blocks of 16 while the pairs average at most 8
    per (slot, expert), of 32 up to 16, of 64 up to 32, and leaves denser batches at vLLM's
    block; it never asks for a larger block than vLLM's config."""
    slot_experts = 32 * 8
    assert _routing_asked(slot_experts + 4).block == 16
    assert _routing_asked(8 * slot_experts).block == 16
    assert _routing_asked(8 * slot_experts + 4).block == 32
    assert _routing_asked(8 * slot_experts + 4, block=128).block == 32
    assert _routing_asked(16 * slot_experts, block=128).block == 32
    assert _routing_asked(16 * slot_experts + 4, block=128).block == 64
    assert _routing_asked(32 * slot_experts, block=128).block == 64
    assert _routing_asked(32 * slot_experts + 4, block=128).block == 128
    assert _routing_asked(8 * slot_experts + 4, block=16).block == 16  # vLLM's is smaller
    assert _routing_asked(16 * slot_experts + 4, block=32).block == 32


def test_the_wrapper_remembers_the_block_of_the_routing_it_aligned() -> None:
    """Where the block is not vLLM's, the wrapper knows it for those sorted ids, also through
    the views add_lora_w13 and add_lora_w2 take of them under inference mode (where a view keeps
    no link to its base); for other tensors, or once it aligned at vLLM's block, it does not."""
    import torch

    from loraplex.kernels.vllm.punica import aligned_block

    asked = _routing_asked(32 * 8 + 4)
    sorted_ids = asked.routing[1]
    with torch.inference_mode():
        view = sorted_ids.view(8, -1)
    assert view._base is None  # what an attribute on the tensor would have needed
    assert aligned_block(asked.punica, sorted_ids) == 16
    assert aligned_block(asked.punica, view) == 16
    assert aligned_block(asked.punica, sorted_ids.clone()) is None
    assert aligned_block(asked.punica, None) is None
    for later in (_routing_asked(32 * 8 + 4, block=16), _routing_asked(16 * 32 * 8 + 4)):
        assert aligned_block(later.punica, later.routing[1]) is None  # vLLM's block
    # The next layer's align on the same wrapper, at vLLM's block, forgets the last one.
    _routing_asked(16 * 32 * 8 + 4, punica=asked.punica)
    assert aligned_block(asked.punica, sorted_ids) is None
    assert _routing_asked(64).routing[1] is None  # naive


def test_the_kernels_get_the_block_the_routing_was_aligned_to() -> None:
    """The wrapped add_lora_fused_moe sets BLOCK_SIZE_M of both configs to the aligned block
    (the caller's dicts untouched) and passes everything else on as given."""
    import torch

    from loraplex.kernels.vllm.punica import configs_at_aligned_block

    seen = []

    def vllm_add(self: object, *args: object, **kwargs: object) -> None:
        seen.append((args, kwargs))

    add = configs_at_aligned_block(vllm_add)
    shrink = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 32}
    expand = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_K": 32}
    head = tuple(torch.zeros(1) for _ in range(5))
    eids, ntpp = torch.zeros(8), torch.zeros(8)
    tail = (torch.ones(9), True)
    sparse, dense, naive = (_routing_asked(p) for p in (32 * 8 + 4, 16 * 32 * 8 + 4, 64))
    other = dataclasses.replace(sparse, routing=(None, torch.zeros(8 * 64)))  # not its routing
    for asked, block in [(sparse, 16), (dense, 64), (naive, 64), (other, 64)]:
        seen.clear()
        sorted_ids = asked.routing[1]
        if sorted_ids is not None:
            with torch.inference_mode():
                sorted_ids = sorted_ids.view(8, -1)
        add(asked.punica, *head, sorted_ids, eids, ntpp, 32, 4, shrink, expand, *tail, offset=3)
        ((args, kwargs),) = seen
        assert args[:5] == head and args[5] is sorted_ids and args[6:10] == (eids, ntpp, 32, 4)
        assert args[10] == {"BLOCK_SIZE_M": block, "BLOCK_SIZE_N": 32}
        assert args[11] == {"BLOCK_SIZE_M": block, "BLOCK_SIZE_K": 32}
        assert args[12:] == tail and kwargs == {"offset": 3}
    assert shrink["BLOCK_SIZE_M"] == 64 and expand["BLOCK_SIZE_M"] == 64


def test_our_routing_forms_left_to_vllm_where_our_op_does_not_serve() -> None:
    """With an expert map (expert parallelism), fully sharded LoRA or a rank our kernels do not
    hold on chip, vLLM's rule and block stand."""
    import torch

    from loraplex.kernels.ops.moe_lora.op import MAX_RANK

    for call in [{"fully_sharded": True}, {"expert_map": torch.arange(32)}, {"rank": 2 * MAX_RANK}]:
        assert not _routing_asked(64, **call).naive
        assert _routing_asked(4 * 32 * 8, **call).block == 64
    assert _routing_asked(64, rank=MAX_RANK).naive
    assert _routing_asked(4 * 32 * 8, rank=MAX_RANK).block == 16


def test_one_active_adapter_sorts_from_four_pairs_per_expert() -> None:
    """Under specialize_active_lora, the naive form also needs at most 4 pairs per (active
    adapter, expert): one adapter sorts GPT-OSS (32 experts) past 128 pairs and Qwen3
    (128 experts) past 512, where 8 adapters stay naive; a count of 0 is unknown."""
    for experts in (32, 128):
        one = _Wrapper(False, 32, active=1, specialize=True)
        assert _routing_asked(4 * experts, experts=experts, punica=one).naive
        assert not _routing_asked(4 * experts + 4, experts=experts, punica=one).naive
        eight = _Wrapper(False, 32, active=8, specialize=True)
        assert _routing_asked(4 * experts + 4, experts=experts, punica=eight).naive
        unknown = _Wrapper(False, 32, active=0, specialize=True)
        assert _routing_asked(4 * experts + 4, experts=experts, punica=unknown).naive


def test_the_count_decides_only_where_vllm_captures_a_graph_per_count() -> None:
    """Without specialize_active_lora a CUDA graph replays its routing form for whatever count a
    later step has, so the step's count is not used, even where it says one adapter."""
    plain = _Wrapper(False, 32, active=1)
    assert _routing_asked(32 * 8, punica=plain).naive
    specialized = _Wrapper(False, 32, active=1, specialize=True)
    assert not _routing_asked(32 * 8, punica=specialized).naive
