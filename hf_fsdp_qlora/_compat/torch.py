"""torch: FSDP1 internals and limits, gloo teardown, distributed checkpoint options, module slots, compile and
grouped_mm."""

from __future__ import annotations

from hf_fsdp_qlora._compat._entry import CANARIES, DOCTOR, LAUNCHED, Workaround

__all__ = ["WORKAROUNDS"]

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        key="module_parameter_slot_swap",
        upstream="torch 2.13 (nn.Module._parameters)",
        works_around="a frozen parameter transformers keeps in float32 is stored in the training dtype (one dtype for "
        "FSDP) and computed in float32: a plain float32 tensor sits in its module's parameter slot for that "
        "module's forward only (nn.Module.__setattr__ accepts only Parameters there)",
        where=("hf_fsdp_qlora.dtypes._upcast", "hf_fsdp_qlora.dtypes._put_back"),
        remove_when="never (a dependency): the test watches the slot's swap and restore",
        canary="tests/test_float32_kept.py::test_a_float32_router_trains_in_float32_on_a_bf16_base",
    ),
    Workaround(
        key="fsdp2_uniform_dtype_among_trainable",
        upstream="torch 2.13 FSDP2 (_fsdp_param_group.FSDPParamGroup._init_mp_dtypes)",
        works_around="fp32 adapters share their decoder layer's fully_shard group with the bf16 base: FSDP2 asks one "
        'dtype only among requires_grad params ("FSDP expects uniform original parameter dtype" otherwise)',
        where=("hf_fsdp_qlora.dtypes.harmonize_dtypes", "hf_fsdp_qlora.train.fsdp.configure_plugin"),
        remove_when="never: if FSDP2 checks every param, fp32 adapters need their own fully_shard groups",
        canary=CANARIES + "test_fsdp2_uniform_dtype_among_trainable_only",
    ),
    Workaround(
        key="fsdp1_plain_cpu_device",
        upstream="torch 2.13 FSDP1 (_init_utils)",
        works_around='FSDP1 refuses device_id cpu:0: "Inconsistent compute device and `device_id` on rank 0"',
        where=("hf_fsdp_qlora.cpu_rehearsal._promote_to_fsdp",),
        remove_when="FSDP1 treats cpu and cpu:0 as one device",
        canary=LAUNCHED,
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
        canary=CANARIES + "test_teardown_internals",
    ),
    Workaround(
        key="fsdp1_use_orig_params",
        upstream="torch 2.13 FSDP1",
        works_around='frozen and trainable params in one unit: "Must flatten tensors with uniform requires_grad"',
        where=("hf_fsdp_qlora.train.fsdp.configure_plugin",),
        remove_when="FSDP1 flattens mixed requires_grad with use_orig_params=False",
        canary=DOCTOR + "[f1_origfalse_accel]",
    ),
    Workaround(
        key="integer_storage_under_fsdp",
        upstream="torch 2.13 FSDP1 (flatten) and accelerate <= 1.15 FSDP2 (fsdp2_prepare_model)",
        works_around='uint8 4-bit storage: FSDP1 "Cannot flatten integer dtype tensors"; FSDP2 leaves it unsharded',
        where=("hf_fsdp_qlora.dtypes.view_packed_storage_as",),
        remove_when="both shard integer-stored Params4bit (the launched canary checks FSDP2, the doctor FSDP1)",
        canary=DOCTOR + "[f1_uint8_stock]",
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
        canary=LAUNCHED,
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
        canary=LAUNCHED,
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
        canary=CANARIES + "test_torch_state_dict_options",
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
        key="torch_compiled_call_impl",
        upstream="torch 2.13 (nn.Module.compile() stores the compiled call in _compiled_call_impl)",
        works_around="proof that compile_layers compiled each layer in place (no public 'is compiled' query)",
        where=("hf_fsdp_qlora.train.compile.compiled_modules",),
        remove_when="torch offers a public way to ask whether a module was compiled in place",
        canary=CANARIES + "test_torch_internals",
    ),
    Workaround(
        key="torch_module_slots",
        upstream="torch 2.13 (nn.Module._parameters / _buffers; torch.utils.deterministic.fill_uninitialized_memory)",
        works_around="tensors are swapped in place during low-RAM loading; no fill of memory overwritten at once",
        where=(
            "hf_fsdp_qlora.loading.low_ram",
            "hf_fsdp_qlora.loading._stream",
            "hf_fsdp_qlora.loading._transfer",
            "hf_fsdp_qlora.experts.stream",
        ),
        remove_when="never (a dependency): the canary watches the private dicts and the flag",
        canary=CANARIES + "test_torch_internals",
    ),
    Workaround(
        key="torch_grouped_mm",
        upstream="torch 2.13 (torch._grouped_mm, public as torch.nn.functional.grouped_mm; CPU kernel since 2.9)",
        works_around="grouped 4-bit experts: its backward refuses an expanded gradient ('Invalid strides/sizes', "
        "as .sum() gives) and rows not a multiple of 16 bytes (LoRA ranks padded); older torch lacks it (loop)",
        where=(
            "hf_fsdp_qlora.experts.grouped.grouped_mm_function",
            "hf_fsdp_qlora.experts.grouped._grouped_mm",
            "hf_fsdp_qlora.experts.grouped.unavailable_reason",
            "hf_fsdp_qlora.experts.grouped._rank_padding",
        ),
        remove_when="grouped_mm is public in every supported torch and takes any stride and an expanded gradient",
        canary=CANARIES + "test_torch_grouped_mm",
    ),
)
