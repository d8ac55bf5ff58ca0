"""peft: adapter dtypes and DoRA/expert LoRA under FSDP1, merging sharded models, and its target matching."""

from __future__ import annotations

from hf_fsdp_qlora._compat._entry import CANARIES, DOCTOR, LAUNCHED, Workaround

__all__ = ["WORKAROUNDS"]

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        key="fsdp1_uniform_dtype",
        upstream="peft <= 0.21 (autocast_adapter_dtype=True, prepare_model_for_kbit_training) with torch FSDP1",
        works_around='fp32 adapters/norms beside bf16 weights: "Must flatten tensors with uniform dtype"',
        where=(
            "hf_fsdp_qlora.dtypes.harmonize_dtypes",
            "hf_fsdp_qlora.loading.qlora",
        ),
        remove_when="FSDP1 flattens mixed dtypes (it will not: FSDP1 is deprecated)",
        canary=DOCTOR + "[f1_kbitprep_stock]",
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
            "hf_fsdp_qlora.experts.lora.attach_expert_lora",
            "hf_fsdp_qlora.experts.lora.peft_sees_expert_weights",
            "hf_fsdp_qlora.experts.lora.quantize_experts_before_peft",
            "hf_fsdp_qlora.experts.lora_rows.run_with_weight",
        ),
        remove_when="peft adapts quantized expert modules itself and reads adapter weights inside their FSDP1 units",
        canary="tests/test_moe.py::test_stock_peft_param_wrapper_contract",
    ),
    Workaround(
        key="sharded_merge_guard",
        upstream="peft <= 0.21 merge_and_unload on an FSDP2-sharded 4-bit model",
        works_around="merge_and_unload on FSDP2 shards crashes (broadcast error or missing quant_state)",
        where=("hf_fsdp_qlora.train.fsdp.guard_sharded_merge",),
        remove_when="peft merges sharded models (it gathers), or refuses with a clear error",
        canary=LAUNCHED,
    ),
    Workaround(
        key="peft_target_check",
        upstream="peft <= 0.21 (peft.tuners.tuners_utils.check_target_module_exists)",
        works_around="the doctor counts LoRA targets exactly as peft matches them",
        where=("hf_fsdp_qlora.model_shapes",),
        remove_when="never (a dependency): the canary watches the signature",
        canary=CANARIES + "test_peft_internals",
    ),
    Workaround(
        key="peft_v5_moe_target_remap",
        upstream="peft <= 0.21 (utils/transformers_weight_conversion.convert_peft_config_for_transformers, run by "
        "inject_adapter on every MoE model type transformers 5 converts)",
        works_around='targets named gate_proj / up_proj / down_proj (leaf or full names, and "all-linear") are '
        "moved onto the routed experts' fused parameters: dense MLPs and shared experts lose their LoRA, and "
        "dropout fails in ParamWrapper (DeepSeek-V2/V3, GLM-4-MoE, Qwen3-Next, Qwen3-MoE mlp_only_layers); it runs on "
        "every config peft loads, so saved adapters name those layers' weights in target_parameters (never remapped)",
        where=(
            "hf_fsdp_qlora.experts.targets.keep_linear_targets",
            "hf_fsdp_qlora.experts.stock_reload.stock_form",
            "hf_fsdp_qlora.experts.stock_reload.linear_weights_as_modules",
        ),
        remove_when="peft converts only adapters written for transformers 4 (or lets a config opt out)",
        canary="tests/test_families_defects.py::test_stock_peft_moves_linear_targets_onto_experts",
    ),
    Workaround(
        key="peft_adapter_key_renames",
        upstream="peft <= 0.21 (utils/transformers_weight_conversion.convert_peft_adapter_state_dict_for_transformers, "
        "run by every adapter load on a model type transformers 5 converts)",
        works_around="a saved adapter's keys, already in the model's names, go through transformers' renamings of the "
        "original checkpoint names: Laguna's 'mlp.shared_expert.' (unescaped dot) and Inkling 2's 'sconv.weight_proj' "
        "move shared-expert / weight_proj LoRA keys off the model, and those tensors load nowhere, silently",
        where=("hf_fsdp_qlora.experts.stock_reload.keep_adapter_keys",),
        remove_when="peft converts only adapter keys that do not already name the model's tensors",
        canary="tests/test_adapter_key_renames.py::test_stock_peft_renames_laguna_shared_expert_keys",
    ),
    Workaround(
        key="script_lora_limited_to_language_model",
        upstream="peft <= 0.21 (BaseTuner.inject_adapter; a script's LoraConfig cannot exclude modules by path)",
        works_around="trl's scripts put all-linear LoRA on a multimodal model's vision/audio towers too",
        where=("hf_fsdp_qlora.loading.script_towers.limit_script_lora_to_language_model",),
        remove_when="peft's all-linear leaves non-text towers out, or scripts can pass exclude_modules",
        canary="tests/test_multimodal.py::test_script_loads_keep_the_towers_16bit",
    ),
)
