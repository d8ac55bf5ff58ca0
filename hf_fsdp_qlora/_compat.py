"""Every place this package works around, patches or leans on upstream internals - one entry each.

The table is executable: ``tests/test_compat.py`` checks that every ``where`` resolves to our code, that every
``canary`` test exists, and that no new private access or patch of upstream appears in the package without an
entry here. A canary runs the STOCK upstream path and fails when upstream changes (fixed, or broken differently):
then read ``remove_when`` and drop or adapt the workaround. Import-light on purpose: no torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["WORKAROUNDS", "Workaround", "by_key"]


@dataclass(frozen=True)
class Workaround:
    key: str
    upstream: str  # the package (versions checked) and issue, if any
    works_around: str  # the upstream behaviour, in one or two lines
    where: tuple[str, ...]  # dotted paths of our code holding the workaround (module[.Class].function)
    remove_when: str
    canary: str  # pytest node id of the test that runs the stock path


_C = "tests/test_compat.py::"
_LAUNCHED = _C + "test_launched_stock_canaries"  # one 2-rank gloo launch, several stock behaviours
_DOCTOR = "tests/test_doctor.py::test_doctor_agrees_with_reality"  # real stock failures, rehearsed on 2 ranks
_MIXIN = "hf_fsdp_qlora.train._trainer_mixin.FSDPSaveMixin"  # our trainer mixin, where many workarounds live

WORKAROUNDS: tuple[Workaround, ...] = (
    # -- accelerate: FSDP on CPU (the CPU rehearsal) --
    Workaround(
        key="cpu_fsdp_decision",
        upstream="accelerate <= 1.15 (state.py takes its FSDP branch for GPU-like device types only)",
        works_around="an FSDP launch on CPU processes silently trains single-process or as DDP",
        where=("hf_fsdp_qlora.cpu_rehearsal.enable_cpu_fsdp", "hf_fsdp_qlora.cpu_rehearsal._promote_to_fsdp"),
        remove_when="accelerate runs FSDP on CPU ranks by itself",
        canary="tests/test_cpu_rehearsal.py::test_upstream_accelerate_does_not_run_fsdp_on_cpu",
    ),
    Workaround(
        key="accelerate_shared_state",
        upstream="accelerate <= 1.15 (private PartialState/AcceleratorState._shared_state, _mixed_precision)",
        works_around="the FSDP decision lives in the states' shared dicts; PartialState() copies it on every build",
        where=(
            "hf_fsdp_qlora.cpu_rehearsal._promote_to_fsdp",
            "hf_fsdp_qlora.cpu_rehearsal.enable_cpu_fsdp",
            "hf_fsdp_qlora.doctor.setup.fsdp_from_plugin",
        ),
        remove_when="cpu_fsdp_decision goes, or accelerate exposes a public way to set the distributed type",
        canary=_C + "test_accelerate_state_internals",
    ),
    Workaround(
        key="fsdp1_plain_cpu_device",
        upstream="torch 2.13 FSDP1 (_init_utils)",
        works_around='FSDP1 refuses device_id cpu:0: "Inconsistent compute device and `device_id` on rank 0"',
        where=("hf_fsdp_qlora.cpu_rehearsal._promote_to_fsdp",),
        remove_when="FSDP1 treats cpu and cpu:0 as one device",
        canary=_LAUNCHED,
    ),
    Workaround(
        key="cpu_fsdp_sync_options",
        upstream="accelerate <= 1.15 (FullyShardedDataParallelPlugin.__post_init__)",
        works_around='FSDP1: sync_module_states / cpu_ram_efficient_loading raise "no available devices found" on CPU',
        where=(
            "hf_fsdp_qlora.doctor._launch_rules.launcher_rules",
        ),  # reported before launch, with the setting to change
        remove_when="the plugin accepts these options on a CPU-only machine",
        canary=_DOCTOR + "[f1_sync_on_cpu]",
    ),
    Workaround(
        key="bf16_training_arguments_on_cpu",
        upstream="transformers <= 5.23 (TrainingArguments.__post_init__; ignores accelerate's use_cpu)",
        works_around="bf16=True (trl's default) without a GPU raises unless use_cpu=True",
        where=("hf_fsdp_qlora.cpu_rehearsal._honour_use_cpu_in_training_arguments",),
        remove_when="transformers honours accelerate's use_cpu, or allows bf16 on CPU",
        canary=_C + "test_stock_training_arguments_refuse_bf16_on_cpu",
    ),
    Workaround(
        key="gloo_teardown_abort",
        upstream="torch 2.13 gloo (about one exit in four without destroy_process_group)",
        works_around='"terminate called without an active exception" at interpreter exit fails a good run',
        where=(
            "hf_fsdp_qlora.cpu_rehearsal._destroy_process_group_at_exit",
            "hf_fsdp_qlora.train.finish.finish_distributed",
        ),
        remove_when="gloo jobs exit cleanly without destroy_process_group (intermittent: watch CI launches)",
        canary=_C + "test_teardown_internals",
    ),
    # -- bitsandbytes --
    Workaround(
        key="bnb_cpu_repack",
        upstream="bitsandbytes <= 0.50 (Linear4bit.forward on AVX512-BF16 CPUs)",
        works_around="a no-grad eval forward repacks 4-bit weights in place; training after evaluate() is corrupted",
        where=(
            "hf_fsdp_qlora._bnb_cpu.prevent_cpu_weight_repack",
            "hf_fsdp_qlora._bnb_cpu.disable_cpu_repack_in_model",
            "hf_fsdp_qlora.train.generation._keep_4bit_layout",
        ),
        remove_when="bitsandbytes stops repacking in place during training-time evaluation",
        canary="tests/test_semantics_eval.py::test_upstream_bitsandbytes_still_repacks",
    ),
    Workaround(
        key="bnb_repack_inverse",
        upstream="bitsandbytes <= 0.50 (private functional._convert_weight_packed_for_cpu_inverse)",
        works_around="a model handed to us already repacked is converted back with bitsandbytes' own inverse",
        where=("hf_fsdp_qlora._bnb_cpu.disable_cpu_repack_in_model",),
        remove_when="bnb_cpu_repack goes",
        canary=_C + "test_bitsandbytes_internals",
    ),
    Workaround(
        key="bnb_params4bit_rebuild",
        upstream="bitsandbytes <= 0.50 (Params4bit(**p.__dict__), module=, bnb_quantized=; module.quant_state)",
        works_around="4-bit weights are rebuilt from received bytes; FSDP2 restores quant_state from the module",
        where=(
            "hf_fsdp_qlora.loading._transfer._new_tensor",
            "hf_fsdp_qlora.loading._stream._produce",
        ),
        remove_when="never while low-RAM loading rebuilds Params4bit (the constructor is the dependency)",
        canary=_C + "test_bitsandbytes_internals",
    ),
    Workaround(
        key="bnb_compute_dtype",
        upstream="bitsandbytes <= 0.50 (Linear4bit.compute_dtype, read by forward)",
        works_around="the 4-bit matmul runs in compute_dtype; it is set to the one training dtype",
        where=("hf_fsdp_qlora.dtypes.harmonize_dtypes",),
        remove_when="never (a dependency): the canary watches the attribute",
        canary=_C + "test_bitsandbytes_internals",
    ),
    Workaround(
        key="integer_storage_under_fsdp",
        upstream="torch 2.13 FSDP1 (flatten) and accelerate <= 1.15 FSDP2 (fsdp2_prepare_model)",
        works_around='uint8 4-bit storage: FSDP1 "Cannot flatten integer dtype tensors"; FSDP2 leaves it unsharded',
        where=("hf_fsdp_qlora.dtypes.view_packed_storage_as",),
        remove_when="both shard integer-stored Params4bit (the launched canary checks FSDP2, the doctor FSDP1)",
        canary=_DOCTOR + "[f1_uint8_stock]",
    ),
    # -- FSDP plugin / mixed precision --
    Workaround(
        key="fsdp_mixed_precision_sync",
        upstream="transformers <= 5.23 (update_fsdp_plugin_peft runs under FSDP1 only, casts buffers)",
        works_around="an FSDP param_dtype other than the 4-bit storage dtype casts the packed bytes: corrupt weights",
        where=(
            "hf_fsdp_qlora.train.fsdp.configure_plugin",
            "hf_fsdp_qlora.train.fsdp._mixed_precision_policy",
        ),
        remove_when="transformers syncs FSDP2's policy to the storage dtype and leaves buffers alone",
        canary=_DOCTOR + "[f2_fp16mp_stock]",
    ),
    Workaround(
        key="fsdp1_uniform_dtype",
        upstream="peft <= 0.21 (autocast_adapter_dtype=True, prepare_model_for_kbit_training) with torch FSDP1",
        works_around='fp32 adapters/norms beside bf16 weights: "Must flatten tensors with uniform dtype"',
        where=(
            "hf_fsdp_qlora.dtypes.harmonize_dtypes",
            "hf_fsdp_qlora.loading.qlora",
        ),
        remove_when="FSDP1 flattens mixed dtypes (it will not: FSDP1 is deprecated)",
        canary=_DOCTOR + "[f1_kbitprep_stock]",
    ),
    Workaround(
        key="fsdp1_use_orig_params",
        upstream="torch 2.13 FSDP1",
        works_around='frozen and trainable params in one unit: "Must flatten tensors with uniform requires_grad"',
        where=("hf_fsdp_qlora.train.fsdp.configure_plugin",),
        remove_when="FSDP1 flattens mixed requires_grad with use_orig_params=False",
        canary=_DOCTOR + "[f1_origfalse_accel]",
    ),
    Workaround(
        key="fsdp1_dora_flat_shard",
        upstream="peft <= 0.21 (DoraLinearLayer.get_lora_weight reads lora_A.weight.shape[1]) with torch FSDP1",
        works_around='DoRA under FSDP1: lora_A is its own unit, its weight a 1-D shard: "IndexError: tuple index '
        'out of range"',
        where=("hf_fsdp_qlora.train.dora.size_dora_identity_from_layer", "hf_fsdp_qlora.train.fsdp.configure_plugin"),
        remove_when="peft sizes DoRA's identity from the layer (in_features), or FSDP1 goes",
        canary="tests/test_dora.py::test_stock_trainer_fails_under_fsdp1",
    ),
    Workaround(
        key="peft_expert_param_wrapper",
        upstream="peft <= 0.21 (lora.ParamWrapper: matches registered parameters only, adapts them through "
        "torch.nn.utils.parametrize; lora_A [r*E, in], lora_B [out, r*E]) with torch FSDP1",
        works_around="LoRA on 4-bit experts (no 16-bit weight to parametrize): stand-ins while peft injects, the "
        "wrappers' forward replaced per instance; under FSDP1 peft's own expert LoRA reads lora_A.weight as a flat "
        "shard: \"RuntimeError: shape '[8, -1, 2048]' is invalid for input of size 2048\"",
        where=(
            "hf_fsdp_qlora.loading.expert_lora.attach_expert_lora",
            "hf_fsdp_qlora.loading.expert_lora.peft_sees_expert_weights",
            "hf_fsdp_qlora.loading.expert_lora.quantize_experts_before_peft",
            "hf_fsdp_qlora.loading.experts.run_with_weight",
        ),
        remove_when="peft adapts quantized expert modules itself and reads adapter weights inside their FSDP1 units",
        canary="tests/test_moe.py::test_stock_peft_param_wrapper_contract",
    ),
    Workaround(
        key="peft_v5_moe_target_remap",
        upstream="peft <= 0.21 (utils/transformers_weight_conversion.convert_peft_config_for_transformers, run by "
        "inject_adapter on every MoE model type transformers 5 converts)",
        works_around='targets named gate_proj / up_proj / down_proj (leaf or full names, and "all-linear") are '
        "moved onto the routed experts' fused parameters: dense MLPs and shared experts lose their LoRA, and "
        "dropout fails in ParamWrapper (DeepSeek-V2/V3, GLM-4-MoE, Qwen3-Next, Qwen3-MoE mlp_only_layers)",
        where=("hf_fsdp_qlora.loading.experts.keep_linear_targets",),
        remove_when="peft converts only adapters written for transformers 4 (or lets a config opt out)",
        canary="tests/test_families_defects.py::test_stock_peft_moves_linear_targets_onto_experts",
    ),
    Workaround(
        key="fsdp2_amp_forward",
        upstream="accelerate <= 1.15 (prepare_model: autocast + fp32 outputs for DDP/FSDP1, not FSDP2)",
        works_around="bf16 logits under FSDP2 only: preference losses differ from DDP and FSDP1",
        where=("hf_fsdp_qlora.train.fsdp.match_amp_forward",),
        remove_when="accelerate's FSDP2 path wraps the forward as its other paths do",
        canary=_LAUNCHED,
    ),
    Workaround(
        key="fsdp1_trainable_upcast",
        upstream="accelerate <= 1.15 (prepare_model upcasts trainable FSDP1 FlatParameters to fp32)",
        works_around='fp32 LoRA recomputed under checkpointing: "CheckpointError: ... different metadata"',
        where=(
            "hf_fsdp_qlora.train.consistency.keep_trainable_in_training_dtype",
            f"{_MIXIN}._follow_wrapping",
        ),
        remove_when="accelerate stops upcasting trainable FlatParameters (or FSDP1 goes)",
        canary=_LAUNCHED,
    ),
    Workaround(
        key="fsdp1_internals",
        upstream="torch 2.13 FSDP1 private _flat_param (_is_flat_param, _numels), _handle, _is_root",
        works_around="engagement check, per-rank sizes, the dtype fix and the root's lazy init read FSDP1 internals",
        where=(
            "hf_fsdp_qlora.train.fsdp.fsdp_engagement",
            "hf_fsdp_qlora.train.callbacks",
            "hf_fsdp_qlora.train.consistency.keep_trainable_in_training_dtype",
            "hf_fsdp_qlora.train._adapter_select.selection_of",
        ),
        remove_when="never while FSDP1 is supported (the canary watches the private names)",
        canary=_LAUNCHED,
    ),
    Workaround(
        key="wrapper_name_segments",
        upstream="torch 2.13 (FSDP1 _fsdp_wrapped_module., checkpoint _checkpoint_wrapped_module., compile _orig_mod)",
        works_around="peft selects adapter keys by name; inside FSDP1 it sees wrapped names (an EMPTY adapter)",
        where=(
            "hf_fsdp_qlora.train._adapter_select.clean_name",
            "hf_fsdp_qlora.train._adapter_select.adapter_selection",
            "hf_fsdp_qlora.train.checkpoint.unwrap_peft_model",
        ),
        remove_when="peft selects adapter keys by parameter identity, not name",
        canary=_LAUNCHED,
    ),
    Workaround(
        key="state_dict_cpu_offload",
        upstream="torch 2.13 (FSDP1 get_model_state_dict(full_state_dict, cpu_offload=True) crashes on CPU ranks)",
        works_around='SIGSEGV or "setStorage: ... out of bounds": cpu_offload is used only on accelerators',
        where=(
            "hf_fsdp_qlora.train.checkpoint.gather_trainable_state_dict",
            "hf_fsdp_qlora.train.checkpoint._options",
            "hf_fsdp_qlora.train.checkpoint.load_adapter_into",
        ),
        remove_when="cpu_offload=True works on CPU ranks (not run as a canary: it crashes the process)",
        canary=_C + "test_torch_state_dict_options",
    ),
    Workaround(
        key="fsdp1_set_state_dict_storage",
        upstream="torch 2.13 (FSDP1 use_orig_params=True: set_model_state_dict swaps the parameters' storage)",
        works_around="loaded parameters stop viewing the FlatParameter the optimizer steps: resume diverges",
        where=("hf_fsdp_qlora.train.checkpoint.load_adapter_into",),
        remove_when="set_model_state_dict copies into FSDP1's views in place",
        # not reproduced by a small stock case (a plain or nested FSDP1 unit keeps its views): guarded on our path
        canary="tests/test_checkpoints.py::test_resume_is_exact",
    ),
    Workaround(
        key="per_rank_lora_init",
        upstream="torch 2.13 (each process seeded differently by default)",
        works_around="without a seed every rank initialises LoRA differently and the shards disagree",
        where=(
            "hf_fsdp_qlora.rank_sync.broadcast_trainable_parameters",
            "hf_fsdp_qlora.train.consistency.make_fsdp_consistent",
        ),
        remove_when="never (ranks may legitimately differ): the canary shows the difference is still there",
        canary="tests/test_trainer_fsdp.py::test_adapters_identical_without_a_seed",
    ),
    Workaround(
        key="sharded_merge_guard",
        upstream="peft <= 0.21 merge_and_unload on an FSDP2-sharded 4-bit model",
        works_around="merge_and_unload on FSDP2 shards crashes (broadcast error or missing quant_state)",
        where=("hf_fsdp_qlora.train.fsdp.guard_sharded_merge",),
        remove_when="peft merges sharded models (it gathers), or refuses with a clear error",
        canary=_LAUNCHED,
    ),
    # -- transformers Trainer: overridden methods and the __init__ hook --
    Workaround(
        key="trainer_init_hook",
        upstream="transformers <= 5.23 (Trainer.__init__ raises before any callback event)",
        works_around="a callback cannot fix what create_accelerator_and_postprocess refuses inside __init__",
        where=("hf_fsdp_qlora.train.trainer_hook.install_trainer_hook",),
        remove_when="a callback can take part in create_accelerator_and_postprocess",
        canary=_C + "test_trainer_private_methods",
    ),
    Workaround(
        key="activation_checkpointing_twice",
        upstream="transformers <= 5.23 (create_accelerator_and_postprocess), trl <= 1.16 default on",
        works_around="FSDP's and the Trainer's activation checkpointing both on raises \"can't both be set to True\"",
        where=(
            f"{_MIXIN}.create_accelerator_and_postprocess",
            "hf_fsdp_qlora.train._trainer_mixin.resolve_activation_checkpointing",
            "hf_fsdp_qlora.train._trainer_mixin._set_trainer_checkpointing",
        ),
        remove_when="transformers resolves the two settings itself",
        canary=_DOCTOR + "[f2_ac_twice_stock]",
    ),
    Workaround(
        key="save_only_model_sharded",
        upstream="transformers <= 5.23 (create_accelerator_and_postprocess)",
        works_around="save_only_model=True with SHARDED_STATE_DICT is refused, though our saves gather the adapter",
        where=(f"{_MIXIN}.create_accelerator_and_postprocess",),
        remove_when="transformers allows the combination (or our saves go)",
        canary=_LAUNCHED,
    ),
    Workaround(
        key="fsdp_adapter_saves",
        upstream="transformers <= 5.23 / peft <= 0.21 / accelerate#4206",
        works_around="stock FSDP saves: nothing (SHARDED), a crash (FSDP2 FULL) or an empty adapter (FSDP1 nested)",
        where=(
            f"{_MIXIN}.save_model",
            "hf_fsdp_qlora.train.checkpoint.save_adapter",
        ),
        remove_when="peft's save_pretrained and Trainer.save_model under FSDP write the gathered adapter",
        canary=_LAUNCHED,
    ),
    Workaround(
        key="checkpoint_staging",
        upstream="transformers <= 5.23 (_save_checkpoint writes into the final folder)",
        works_around="a run killed mid-save leaves a checkpoint-N that resume_from_checkpoint=True picks up",
        where=(f"{_MIXIN}._get_output_dir", f"{_MIXIN}._save_checkpoint"),
        remove_when="transformers writes checkpoints atomically",
        canary=_C + "test_trainer_private_methods",
    ),
    Workaround(
        key="preemption_finalize",
        upstream="transformers <= 5.23 (_finalize_training loads the best model and rotates checkpoints after a stop)",
        works_around=(
            "after a preemption stop, load_best_model_at_end loads inside the kill-grace window and "
            "save_total_limit=1 deletes the preemption checkpoint that preempted.json names"
        ),
        where=(f"{_MIXIN}._finalize_training",),
        remove_when="transformers skips best-model loading and rotation when a callback stops training to save",
        canary="tests/test_preemption.py::test_best_model_at_end_keeps_the_preemption_checkpoint",
    ),
    Workaround(
        key="experts_apply_gate",
        upstream="transformers <= 5.23 (each MoE family's experts module keeps its activation in private _apply_gate)",
        works_around=(
            "our 4-bit experts must apply the family's own gate (SwiGLU, gpt-oss's clamped variant) between the "
            "dequantized gate_up and down projections; no public hook exposes it"
        ),
        where=(
            "hf_fsdp_qlora.expert_layouts.expert_layout",
            "hf_fsdp_qlora.loading.experts.QuantizedExperts.__init__",
        ),
        remove_when="transformers exposes the experts' activation publicly (or ships quantized experts itself)",
        canary="tests/test_moe.py::test_forward_and_gradients_match_dequantized_oracle",
    ),
    Workaround(
        key="optimizer_state_gathered",
        upstream="accelerate <= 1.15 (FSDP1 optimizer load aliased exp_avg to exp_avg_sq; FSDP1 FULL save segfaults)",
        works_around="resumed FSDP1 runs diverged after one step; adapter runs checkpoint an empty model state",
        where=(
            f"{_MIXIN}._save_optimizer_and_scheduler",
            f"{_MIXIN}._load_optimizer_and_scheduler",
            "hf_fsdp_qlora.train.checkpoint.gather_optimizer_state",
        ),
        remove_when="accelerate's FSDP optimizer save/load round-trips exactly on CPU and GPU",
        # a small stock FSDP1 Adam save/load round-trips exactly: the hooks we override are watched instead
        canary=_C + "test_trainer_private_methods",
    ),
    Workaround(
        key="resume_adapter_checkpoint",
        upstream="transformers <= 5.23 (_load_from_checkpoint expects an FSDP model state; transformers#28320)",
        works_around="resuming an adapter-only checkpoint under FSDP restarts the adapter silently",
        where=(
            f"{_MIXIN}._load_from_checkpoint",
            "hf_fsdp_qlora.train.checkpoint.load_adapter_into",
        ),
        remove_when="stock resume restores a peft adapter under FSDP",
        canary=_C + "test_trainer_private_methods",
    ),
    Workaround(
        key="evaluate_before_train",
        upstream="transformers <= 5.23 (#39961, #48841)",
        works_around="evaluate() before train(): FSDP2 raises; FSDP1 then builds no optimizer in train()",
        where=(
            f"{_MIXIN}.evaluation_loop",
            "hf_fsdp_qlora.train.generation.prepare_for_evaluation",
        ),
        remove_when="stock evaluation_loop prepares model and optimizer together under FSDP",
        canary="tests/test_eval_generate.py::test_stock_trainer_evaluate_before_training_is_the_upstream_bug",
    ),
    Workaround(
        key="chunked_loss_head_forward",
        upstream="transformers <= 5.23: Trainer.compute_loss / ForCausalLMLoss need the full logits",
        works_around="[batch x seq x vocab] logits + fp32 copy + grad: the head's forward is a chunked loss for one "
        "call, and the model's loss_function (transformers' setter keeps it in `_loss_function`) passes it through",
        where=(
            f"{_MIXIN}.compute_loss",
            f"{_MIXIN}.prediction_step",
            "hf_fsdp_qlora.train.loss._fused_head",
            "hf_fsdp_qlora.train.loss._replaced",
        ),
        remove_when="transformers computes the causal-LM loss from the hidden states in chunks itself",
        canary="tests/test_chunked_loss.py::test_compute_loss_num_items_and_all_masked",
    ),
    Workaround(
        key="preemption_trainer_hooks",
        upstream="transformers <= 5.23 (no preemption handling; accelerate#3400)",
        works_around="a scheduler's signal ends training without a checkpoint; a callback cannot end an evaluation",
        where=(
            "hf_fsdp_qlora.train._trainer_mixin.FSDPSaveMixin.train",
            "hf_fsdp_qlora.train._trainer_mixin.FSDPSaveMixin.evaluate",
        ),
        remove_when="Trainer checkpoints on a signal agreed across ranks, and lets a callback stop an evaluation",
        canary="tests/test_preemption.py::test_stock_trainer_structure_preemption_relies_on",
    ),
    Workaround(
        key="accelerator_private_lists",
        upstream="accelerate <= 1.15 (Accelerator._models, _optimizers); transformers 5.23 _is_peft_model",
        works_around="evaluation wraps the model alone: a placeholder optimizer is prepared and dropped again",
        where=("hf_fsdp_qlora.train.generation.prepare_for_evaluation",),
        remove_when="evaluate_before_train goes",
        canary=_LAUNCHED,
    ),
    Workaround(
        key="packed_mask_needs_no_cache",
        upstream="transformers 5.23 (the position_ids block-diagonal mask is skipped when a KV cache is built)",
        works_around="packed examples attend to earlier ones in their block when the config says use_cache=True",
        where=("hf_fsdp_qlora.data.PackedCollator", "hf_fsdp_qlora.train.packing.check_padding_free"),
        remove_when="transformers builds the packed mask with a cache too (or never builds a cache in training)",
        canary=_C + "test_packed_mask_skipped_with_a_cache",
    ),
    Workaround(
        key="packed_mask_functions",
        upstream="transformers 5.23 (PretrainedConfig._attn_implementation; masking_utils.ALL_MASK_ATTENTION_FUNCTIONS)",
        works_around="an attention function registered without a mask function gets no mask for a padding-free batch",
        where=("hf_fsdp_qlora.train.packing._config_of",),
        remove_when="never while padding-free training is checked: the canary watches both names",
        canary="tests/test_packing.py::test_attention_without_mask_refused_at_train_start",
    ),
    # -- transformers / peft / accelerate internals used for loading, merging and the doctor --
    Workaround(
        key="quantizer_skeleton",
        upstream="transformers 5.23 (transformers.quantizers.auto.get_hf_quantizer, preprocess/postprocess_model)",
        works_around="low-RAM ranks build from_pretrained's 4-bit module tree on meta without reading weights",
        where=("hf_fsdp_qlora.loading.low_ram._build_skeleton",),
        remove_when="never while low-RAM loading exists (a dependency): the canary watches the signatures",
        canary=_C + "test_transformers_internals",
    ),
    Workaround(
        key="torch_compiled_call_impl",
        upstream="torch 2.13 (nn.Module.compile() stores the compiled call in _compiled_call_impl)",
        works_around="proof that compile_layers compiled each layer in place (no public 'is compiled' query)",
        where=("hf_fsdp_qlora.train.compile.compiled_modules",),
        remove_when="torch offers a public way to ask whether a module was compiled in place",
        canary=_C + "test_torch_internals",
    ),
    Workaround(
        key="torch_module_slots",
        upstream="torch 2.13 (nn.Module._parameters / _buffers; torch.utils.deterministic.fill_uninitialized_memory)",
        works_around="tensors are swapped in place during low-RAM loading; no fill of memory overwritten at once",
        where=(
            "hf_fsdp_qlora.loading.low_ram",
            "hf_fsdp_qlora.loading._stream",
            "hf_fsdp_qlora.loading._transfer",
        ),
        remove_when="never (a dependency): the canary watches the private dicts and the flag",
        canary=_C + "test_torch_internals",
    ),
    Workaround(
        key="model_class_private_attrs",
        upstream="transformers 5.23 (_tied_weights_keys dict, _keep_in_fp32_modules(_strict), _no_split_modules)",
        works_around="tied aliases, fp32-kept modules and layer classes are read from the model class",
        where=(
            "hf_fsdp_qlora.merge._base_model",
            "hf_fsdp_qlora.loading._stream.stream_plan",
            "hf_fsdp_qlora.model_shapes",
        ),
        remove_when="never (a dependency): the canary watches the attributes' form",
        canary=_C + "test_transformers_internals",
    ),
    Workaround(
        key="accelerate_launch_internals",
        upstream="accelerate <= 1.15 (_validate_launch_command, launch_command_parser()._actions)",
        works_around="accelerate ignores unknown fsdp_config keys silently; the doctor replays its launch parsing",
        where=(
            "hf_fsdp_qlora.doctor.setup._fields_of_launch_parser",
            "hf_fsdp_qlora.doctor.setup._launch_env",
        ),
        remove_when="accelerate refuses unknown fsdp_config keys and exposes its launch environment",
        canary=_C + "test_accelerate_launch_internals",
    ),
    Workaround(
        key="peft_target_check",
        upstream="peft <= 0.21 (peft.tuners.tuners_utils.check_target_module_exists)",
        works_around="the doctor counts LoRA targets exactly as peft matches them",
        where=("hf_fsdp_qlora.model_shapes",),
        remove_when="never (a dependency): the canary watches the signature",
        canary=_C + "test_peft_internals",
    ),
    Workaround(
        key="upstream_noise",
        upstream=(
            "bitsandbytes 0.50 (warns at import), peft <= 0.21 (reads transformers 5's deprecated property), "
            "trl <= 1.16 (its configs pass the deprecated gradient_checkpointing)"
        ),
        works_around=(
            "upstream lines with nothing to act on, on every rank (the list: hf_fsdp_qlora._quiet.NOISE); the "
            "caller's frame (sys._getframe) tells upstream's trigger from the user's own"
        ),
        where=("hf_fsdp_qlora._quiet.quiet_upstream", "hf_fsdp_qlora._quiet._show_unless_noise"),
        remove_when="upstream stops printing an entry of NOISE (drop that entry)",
        canary="tests/test_quiet.py::test_quiet_by_default_and_verbose_shows_upstream",
    ),
)


def by_key(key: str) -> Workaround:
    """The entry named `key` (KeyError when there is none)."""
    for entry in WORKAROUNDS:
        if entry.key == key:
            return entry
    raise KeyError(key)
