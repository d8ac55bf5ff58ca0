"""transformers: the Trainer hooks we override (saving, resuming, evaluation, the loss, preemption), its
TrainingArguments on CPU, packed-sequence masks, the quantizer skeleton and model-class attributes."""

from __future__ import annotations

from hf_fsdp_qlora._compat._entry import CANARIES, DOCTOR, LAUNCHED, MIXIN, Workaround

__all__ = ["WORKAROUNDS"]

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        key="dtype_plan_float32_layers",
        upstream="transformers 5.24 (PreTrainedModel._get_dtype_plan; the bitsandbytes 4-bit quantizer skips "
        "_keep_in_fp32_modules but not _keep_in_fp32_modules_strict)",
        works_around="linear layers transformers loads in float32 into a 16-bit model (HY-V4's indexer weights_proj) "
        "were quantized to 4 bits, and merged back round-tripped through NF4",
        where=("hf_fsdp_qlora.loading.family_targets.float32_linear_layers",),
        remove_when="transformers' bitsandbytes quantizer skips _keep_in_fp32_modules_strict too",
        canary="tests/test_float32_kept.py::test_a_linear_layer_kept_float32_stays_out_of_4_bits",
    ),
    Workaround(
        key="num_input_tokens_under_sequence_parallelism",
        upstream="transformers <= 5.24 (Trainer._track_num_input_tokens sums every rank's batch)",
        works_around="under sp_size a group's ranks share each batch, so num_input_tokens_seen counted it sp_size times",
        where=(f"{MIXIN}._track_num_input_tokens",),
        remove_when="transformers counts a batch once per data-parallel group (or we drop sp_size)",
        canary="tests/test_sequence_parallel.py::test_sp2_evaluation_and_predict_equal_one_process",
    ),
    Workaround(
        key="input_require_grads_hook",
        upstream="transformers <= 5.24 (PreTrainedModel.enable_input_require_grads keeps its handle privately)",
        works_around="the hook reentrant checkpointing needs back-propagates every step into the frozen embeddings "
        "under FSDP's own (non-reentrant) checkpointing: extra 4-bit matmuls per step",
        where=("hf_fsdp_qlora.train.accelerator_setup._stop_forcing_input_grads",),
        remove_when="transformers exposes the handle, or disables the hook for non-reentrant checkpointing",
        canary="tests/test_single_process.py::test_fsdp_checkpointing_stops_forcing_input_grads",
    ),
    Workaround(
        key="bf16_training_arguments_on_cpu",
        upstream="transformers <= 5.23 (TrainingArguments.__post_init__; ignores accelerate's use_cpu)",
        works_around="bf16=True (trl's default) without a GPU raises unless use_cpu=True",
        where=("hf_fsdp_qlora.cpu_rehearsal._honour_use_cpu_in_training_arguments",),
        remove_when="transformers honours accelerate's use_cpu, or allows bf16 on CPU",
        canary=CANARIES + "test_stock_training_arguments_refuse_bf16_on_cpu",
    ),
    Workaround(
        key="fsdp_mixed_precision_sync",
        upstream="transformers <= 5.23 (update_fsdp_plugin_peft runs under FSDP1 only, casts buffers)",
        works_around="an FSDP param_dtype other than the 4-bit storage dtype casts the packed bytes: corrupt weights",
        where=(
            "hf_fsdp_qlora.train.fsdp.configure_plugin",
            "hf_fsdp_qlora.train.fsdp._mixed_precision_policy",
        ),
        remove_when="transformers syncs FSDP2's policy to the storage dtype and leaves buffers alone",
        canary=DOCTOR + "[f2_fp16mp_stock]",
    ),
    Workaround(
        key="trainer_init_hook",
        upstream="transformers <= 5.23 (Trainer.__init__ raises before any callback event)",
        works_around="a callback cannot fix what create_accelerator_and_postprocess refuses inside __init__",
        where=("hf_fsdp_qlora.train.trainer_hook.install_trainer_hook",),
        remove_when="a callback can take part in create_accelerator_and_postprocess",
        canary=CANARIES + "test_trainer_private_methods",
    ),
    Workaround(
        key="activation_checkpointing_twice",
        upstream="transformers <= 5.23 (create_accelerator_and_postprocess), trl <= 1.16 default on",
        works_around="FSDP's and the Trainer's activation checkpointing both on raises \"can't both be set to True\"",
        where=(
            f"{MIXIN}.create_accelerator_and_postprocess",
            "hf_fsdp_qlora.train.accelerator_setup.set_aside_refused_settings",
            "hf_fsdp_qlora.train.accelerator_setup.resolve_activation_checkpointing",
            "hf_fsdp_qlora.train.accelerator_setup._set_trainer_checkpointing",
        ),
        remove_when="transformers resolves the two settings itself",
        canary=DOCTOR + "[f2_ac_twice_stock]",
    ),
    Workaround(
        key="save_only_model_sharded",
        upstream="transformers <= 5.23 (create_accelerator_and_postprocess)",
        works_around="save_only_model=True with SHARDED_STATE_DICT is refused, though our saves gather the adapter",
        where=(
            f"{MIXIN}.create_accelerator_and_postprocess",
            "hf_fsdp_qlora.train.accelerator_setup.set_aside_refused_settings",
        ),
        remove_when="transformers allows the combination (or our saves go)",
        canary=LAUNCHED,
    ),
    Workaround(
        key="fsdp_adapter_saves",
        upstream="transformers <= 5.23 / peft <= 0.21 / accelerate#4206",
        works_around="stock FSDP saves: nothing (SHARDED), a crash (FSDP2 FULL) or an empty adapter (FSDP1 nested)",
        where=(
            f"{MIXIN}.save_model",
            "hf_fsdp_qlora.train.checkpoint_hooks.save_model",
            "hf_fsdp_qlora.train.checkpoint.save_adapter",
        ),
        remove_when="peft's save_pretrained and Trainer.save_model under FSDP write the gathered adapter",
        canary=LAUNCHED,
    ),
    Workaround(
        key="checkpoint_staging",
        upstream="transformers <= 5.23 (_save_checkpoint writes into the final folder)",
        works_around="a run killed mid-save leaves a checkpoint-N that resume_from_checkpoint=True picks up",
        where=(
            f"{MIXIN}._get_output_dir",
            f"{MIXIN}._save_checkpoint",
            "hf_fsdp_qlora.train.checkpoint_hooks.staged_output_dir",
            "hf_fsdp_qlora.train.checkpoint_hooks.save_checkpoint",
        ),
        remove_when="transformers writes checkpoints atomically",
        canary=CANARIES + "test_trainer_private_methods",
    ),
    Workaround(
        key="preemption_finalize",
        upstream="transformers <= 5.23 (_finalize_training loads the best model and rotates checkpoints after a stop)",
        works_around=(
            "after a preemption stop, load_best_model_at_end loads inside the kill-grace window and "
            "save_total_limit=1 deletes the preemption checkpoint that preempted.json names"
        ),
        where=(f"{MIXIN}._finalize_training", "hf_fsdp_qlora.train.preemption_callback.finalize_training"),
        remove_when="transformers skips best-model loading and rotation when a callback stops training to save",
        canary="tests/test_preemption.py::test_best_model_at_end_keeps_the_preemption_checkpoint",
    ),
    Workaround(
        key="resume_adapter_checkpoint",
        upstream="transformers <= 5.23 (_load_from_checkpoint expects an FSDP model state; transformers#28320)",
        works_around="resuming an adapter-only checkpoint under FSDP restarts the adapter silently",
        where=(
            f"{MIXIN}._load_from_checkpoint",
            "hf_fsdp_qlora.train.checkpoint_hooks.load_from_checkpoint",
            "hf_fsdp_qlora.train.checkpoint.load_adapter_into",
        ),
        remove_when="stock resume restores a peft adapter under FSDP",
        canary=CANARIES + "test_trainer_private_methods",
    ),
    Workaround(
        key="evaluate_before_train",
        upstream="transformers <= 5.23 (#39961, #48841)",
        works_around="evaluate() before train(): FSDP2 raises; FSDP1 then builds no optimizer in train()",
        where=(
            f"{MIXIN}.evaluation_loop",
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
            f"{MIXIN}.compute_loss",
            f"{MIXIN}.prediction_step",
            "hf_fsdp_qlora.train.loss.loss_only_prediction",
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
            f"{MIXIN}.train",
            f"{MIXIN}.evaluate",
            "hf_fsdp_qlora.train.preemption_callback.train_then_exit_if_preempted",
            "hf_fsdp_qlora.train.preemption_callback.evaluate_unless_stopped",
        ),
        remove_when="Trainer checkpoints on a signal agreed across ranks, and lets a callback stop an evaluation",
        canary="tests/test_preemption.py::test_stock_trainer_structure_preemption_relies_on",
    ),
    Workaround(
        key="packed_mask_needs_no_cache",
        upstream="transformers 5.23 (the position_ids block-diagonal mask is skipped when a KV cache is built)",
        works_around="packed examples attend to earlier ones in their block when the config says use_cache=True",
        where=("hf_fsdp_qlora.data.PackedCollator", "hf_fsdp_qlora.train.packing.check_padding_free"),
        remove_when="transformers builds the packed mask with a cache too (or never builds a cache in training)",
        canary=CANARIES + "test_packed_mask_skipped_with_a_cache",
    ),
    Workaround(
        key="packed_mask_functions",
        upstream="transformers 5.23 (PretrainedConfig._attn_implementation; masking_utils.ALL_MASK_ATTENTION_FUNCTIONS)",
        works_around="an attention function registered without a mask function gets no mask for a padding-free batch",
        where=("hf_fsdp_qlora.train.packing._config_of",),
        remove_when="never while padding-free training is checked: the canary watches both names",
        canary="tests/test_packing.py::test_attention_without_mask_refused_at_train_start",
    ),
    Workaround(
        key="quantizer_skeleton",
        upstream="transformers 5.23 (transformers.quantizers.auto.get_hf_quantizer, preprocess/postprocess_model)",
        works_around="low-RAM ranks build from_pretrained's 4-bit module tree on meta without reading weights",
        where=("hf_fsdp_qlora.loading.low_ram._build_skeleton",),
        remove_when="never while low-RAM loading exists (a dependency): the canary watches the signatures",
        canary=CANARIES + "test_transformers_internals",
    ),
    Workaround(
        key="experts_left_unread",
        upstream="transformers 5.23 (PreTrainedModel._initialize_weights skips a module with _is_hf_initialized; "
        "_keys_to_ignore_on_load_missing / _unexpected; from_pretrained's key_mapping)",
        works_around="from_pretrained would read every expert tensor 16-bit and draw random values for hidden ones",
        where=("hf_fsdp_qlora.experts.stream.experts_left_unread",),
        remove_when="transformers can load a model leaving chosen parameters unread (or quantizes fused experts)",
        canary="tests/test_moe_stream.py::test_transformers_leaves_hidden_experts_unread",
    ),
    Workaround(
        key="script_from_pretrained_streams_experts",
        upstream="transformers 5.23 (PreTrainedModel.from_pretrained, a classmethod; bitsandbytes' 4-bit quantizer "
        "packs nn.Linear only) as trl 1.16's SFTTrainer calls it (create_model_from_path)",
        works_around="an unchanged script's 4-bit load of an MoE checkpoint holds every expert 16-bit before the "
        "launcher's peft hook packs them (Qwen3-30B-A3B: ~54 GiB per process)",
        where=("hf_fsdp_qlora.experts.script_stream.stream_experts_of_script_loads",),
        remove_when="transformers quantizes fused experts while loading (or loads chosen parameters unread)",
        canary="tests/test_moe_stream.py::test_script_from_pretrained_streams_what_the_peft_hook_packed",
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
        canary=CANARIES + "test_transformers_internals",
    ),
    Workaround(
        key="experts_apply_gate",
        upstream="transformers <= 5.23 (each MoE family's experts module keeps its activation in private _apply_gate)",
        works_around=(
            "our 4-bit experts must apply the family's own gate (SwiGLU, gpt-oss's clamped variant) between the "
            "dequantized gate_up and down projections; no public hook exposes it"
        ),
        where=(
            "hf_fsdp_qlora.experts.layouts._fits",
            "hf_fsdp_qlora.experts.quantized.QuantizedExperts.__init__",
        ),
        remove_when="transformers exposes the experts' activation publicly (or ships quantized experts itself)",
        canary="tests/test_moe.py::test_forward_and_gradients_match_dequantized_oracle",
    ),
    Workaround(
        key="ulysses_sequence_parallel",
        upstream="transformers 5.23 / accelerate 1.15 (sequence parallelism only with sp_backend='deepspeed'; "
        "PretrainedConfig._attn_implementation)",
        works_around="no Ulysses sequence parallelism under FSDP: our attention function reads and selects the "
        "model's implementation, and the train dataloader is sharded by sequence-parallel group, not by rank",
        where=(
            f"{MIXIN}.get_train_dataloader",
            "hf_fsdp_qlora.train.sequence_parallel.check_sequence_parallel",
            "hf_fsdp_qlora.train.sequence_parallel._select_attention",
            "hf_fsdp_qlora.train.launcher.hand_over_accelerate_sp_size",
        ),
        remove_when="accelerate's ParallelismConfig offers an sp_backend for FSDP2 that transformers' Trainer runs",
        canary="tests/test_sequence_parallel.py::test_stock_sequence_parallelism_is_deepspeed_only",
    ),
    Workaround(
        key="tiled_mlp_forward",
        upstream="transformers 5.23 (each MLP's forward keeps the whole sequence's intermediate activations)",
        works_around="the MLP's intermediates dominate long sequences: an instance's forward runs over checkpointed "
        "tiles (the class is untouched)",
        where=("hf_fsdp_qlora.train.tiled_mlp.install_tiled_mlp",),
        remove_when="transformers tiles its MLPs itself",
        canary="tests/test_tiled_mlp.py::test_tiled_mlp_keeps_one_tiles_intermediates",
    ),
    Workaround(
        key="inherited_no_split_modules",
        upstream="transformers <= 5.24 (composite classes inherit their towers' _no_split_modules, e.g. Gemma 3's "
        "SigLIP text embeddings it does not hold)",
        works_around='FSDP1/FSDP2 auto-wrap raises "Could not find the transformer layer class ..." for a listed '
        "class the model lacks",
        where=("hf_fsdp_qlora.towers.keep_present_layer_classes",),
        remove_when="transformers lists only the classes a composite model builds",
        canary="tests/test_multimodal_train.py::test_trains_with_16bit_frozen_towers_sharded_in_their_own_units",
    ),
    Workaround(
        key="auto_class_mapping_on_meta",
        upstream="transformers <= 5.24 (auto classes keep their config-to-class map in _model_mapping; "
        "PreTrainedModel._from_config builds without loading)",
        works_around="the loader and the doctor need the concrete class an auto class picks, and the model's "
        "module tree on the meta device, to find the towers before anything is loaded",
        where=(
            "hf_fsdp_qlora.towers.concrete_class",
            "hf_fsdp_qlora.towers.meta_model",
            "hf_fsdp_qlora.loading.family_targets.frozen_by_model",
        ),
        remove_when="never (a dependency): the canary watches both",
        canary="tests/test_multimodal.py::test_doctor_plans_the_towers_16bit",
    ),
    Workaround(
        key="input_require_grads_in_place",
        upstream="transformers <= 5.24 (PreTrainedModel.enable_input_require_grads: the hook makes the embedding "
        "output a leaf that requires grad, kept in _require_grads_hook)",
        works_around="a model that adds to its embedding output in place (BLT) raises 'a leaf Variable that requires "
        "grad is being used in an in-place operation' with a frozen base",
        where=("hf_fsdp_qlora.loading._adapter_steps.enable_input_grads",),
        remove_when="transformers' hook returns a non-leaf output",
        canary="tests/test_family_targets.py::test_input_grad_hook_lets_the_model_add_to_the_embedding_output_in_place",
    ),
)
