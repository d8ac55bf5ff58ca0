"""accelerate: FSDP on CPU ranks, its state singletons, prepare_model's FSDP paths, optimizer checkpoints
and the launch parser the doctor replays."""

from __future__ import annotations

from hf_fsdp_qlora._compat._entry import CANARIES, DOCTOR, LAUNCHED, MIXIN, Workaround

__all__ = ["WORKAROUNDS"]

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        key="fsdp2_checkpointing_rng_state",
        upstream="accelerate <= 1.15 (fsdp2_apply_ac: checkpoint_wrapper(layer, preserve_rng_state=False))",
        works_around="with dropout in a layer the backward's recomputation drew other masks than the forward: "
        "LoRA gradients not those of the computed loss (0 of 28 tensors equal at lora_dropout 0.1)",
        where=("hf_fsdp_qlora.train.accelerator_setup.preserve_checkpoint_rng_state",),
        remove_when="accelerate keeps torch's default preserve_rng_state=True",
        canary="tests/test_precision.py::test_fsdp2_checkpointing_recomputes_with_the_forward_dropout_masks",
    ),
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
        canary=CANARIES + "test_accelerate_state_internals",
    ),
    Workaround(
        key="cpu_fsdp_sync_options",
        upstream="accelerate <= 1.15 (FullyShardedDataParallelPlugin.__post_init__)",
        works_around='FSDP1: sync_module_states / cpu_ram_efficient_loading raise "no available devices found" on CPU',
        where=(
            "hf_fsdp_qlora.doctor._launch_rules.launcher_rules",
        ),  # reported before launch, with the setting to change
        remove_when="the plugin accepts these options on a CPU-only machine",
        canary=DOCTOR + "[f1_sync_on_cpu]",
    ),
    Workaround(
        key="fsdp2_amp_forward",
        upstream="accelerate <= 1.15 (prepare_model: autocast + fp32 outputs for DDP/FSDP1, not FSDP2)",
        works_around="bf16 logits under FSDP2 only: preference losses differ from DDP and FSDP1",
        where=("hf_fsdp_qlora.train.fsdp.match_amp_forward",),
        remove_when="accelerate's FSDP2 path wraps the forward as its other paths do",
        canary=LAUNCHED,
    ),
    Workaround(
        key="fsdp1_trainable_upcast",
        upstream="accelerate <= 1.15 (prepare_model upcasts trainable FSDP1 FlatParameters to fp32)",
        works_around='fp32 LoRA recomputed under checkpointing: "CheckpointError: ... different metadata"',
        where=(
            "hf_fsdp_qlora.train.consistency.keep_trainable_in_training_dtype",
            "hf_fsdp_qlora.train.consistency.follow_wrapping",
        ),
        remove_when="accelerate stops upcasting trainable FlatParameters (or FSDP1 goes)",
        canary=LAUNCHED,
    ),
    Workaround(
        key="optimizer_state_gathered",
        upstream="accelerate <= 1.15 (FSDP1 optimizer load aliased exp_avg to exp_avg_sq; FSDP1 FULL save segfaults)",
        works_around="resumed FSDP1 runs diverged after one step; adapter runs checkpoint an empty model state",
        where=(
            f"{MIXIN}._save_optimizer_and_scheduler",
            f"{MIXIN}._load_optimizer_and_scheduler",
            "hf_fsdp_qlora.train.checkpoint_hooks.save_optimizer_and_scheduler",
            "hf_fsdp_qlora.train.checkpoint_hooks.load_optimizer_and_scheduler",
            "hf_fsdp_qlora.train.checkpoint.gather_optimizer_state",
        ),
        remove_when="accelerate's FSDP optimizer save/load round-trips exactly on CPU and GPU",
        # a small stock FSDP1 Adam save/load round-trips exactly: the hooks we override are watched instead
        canary=CANARIES + "test_trainer_private_methods",
    ),
    Workaround(
        key="accelerator_private_lists",
        upstream="accelerate <= 1.15 (Accelerator._models, _optimizers); transformers 5.23 _is_peft_model",
        works_around="evaluation wraps the model alone: a placeholder optimizer is prepared and dropped again",
        where=("hf_fsdp_qlora.train.generation.prepare_for_evaluation",),
        remove_when="evaluate_before_train goes",
        canary=LAUNCHED,
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
        canary=CANARIES + "test_accelerate_launch_internals",
    ),
)
