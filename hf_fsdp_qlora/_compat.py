"""Where this package leans on upstream behaviour that may change, and when each piece can go.

Each entry names the module that holds the workaround and the test that fails when upstream moves:

* ``cpu_rehearsal``: accelerate (<= 1.15) takes its FSDP branch only for GPU-like devices, so FSDP on
  CPU silently becomes DDP or single-process training. Remove when accelerate runs FSDP on CPU itself;
  ``tests/test_cpu_rehearsal.py::test_upstream_accelerate_does_not_run_fsdp_on_cpu`` fails then.
* ``fsdp.configure_plugin``: transformers (<= 5.23) syncs FSDP mixed precision to the 4-bit storage
  dtype under FSDP1 only, and casts buffers too. Keep while transformers' ``update_fsdp_plugin_peft``
  does so (``tests/test_trainer_fsdp.py`` compares logits with the unsharded model exactly).
* ``_adapter_select.adapter_selection``: peft (<= 0.21) selects adapter keys by the module names it sees, which
  inside FSDP1 carry ``_fsdp_wrapped_module.``; an unsharded state dict then yields an EMPTY adapter.
* ``_bnb_cpu``: bitsandbytes (<= 0.50) repacks 4-bit weights in place at a no-grad CPU forward on
  AVX512-BF16 CPUs, corrupting training after an ``evaluate()``; remove when it no longer does
  (``tests/test_semantics_eval.py::test_upstream_bitsandbytes_still_repacks`` fails then).
* ``fsdp.match_amp_forward``: accelerate (<= 1.15) wraps the forward in autocast with fp32 outputs for DDP
  and FSDP1 but not FSDP2; remove when its FSDP2 path does the same (``tests/test_semantics_pref.py``).
* ``fsdp.fsdp_engagement``: FSDP1's FlatParameter is tagged ``_is_flat_param`` (torch 2.13); checked by
  every distributed test that asserts engagement.
* ``_trainer_mixin`` / ``checkpoint.gather_optimizer_state``: accelerate's (<= 1.15) FSDP1 optimizer load
  aliased Adam's ``exp_avg`` to ``exp_avg_sq`` (resumed runs diverged after one step), and its FSDP1
  FULL model save segfaulted on CPU ranks; adapter and full-form checkpoints use torch's distributed
  state-dict API instead. ``tests/test_checkpoints.py`` (exact resume, FSDP1 and FSDP2) guards both.
* ``dtypes.view_packed_storage_as``: accelerate's FSDP2 (<= 1.15) excludes integer-stored Params4bit
  from sharding; ``tests/test_sharding.py`` checks every 4-bit weight is a half-size DTensor shard.
* ``trainer_hook.install_trainer_hook``: wraps ``transformers.Trainer.__init__`` so a trainer built with
  ``FSDPQLoRACallback`` (or every trainer, under ``python -m hf_fsdp_qlora.run``) gets our mixin: transformers
  (<= 5.23) raises on FSDP + Trainer activation checkpointing inside ``__init__``, before any callback event, and
  its FSDP saves write no adapter (FSDP2) or crash (FSDP1 on CPU). Remove when a callback can take part in
  ``create_accelerator_and_postprocess`` and the stock saves gather adapters; ``tests/test_recipes.py`` runs the
  stock Trainer and trl's DPOTrainer through it.
* ``_trainer_mixin.resolve_activation_checkpointing``: transformers (<= 5.23) refuses FSDP's activation
  checkpointing together with the Trainer's, which trl (<= 1.16) turns on by default; ``tests/test_recipes.py``
  counts one recomputation per layer and step.
* ``cpu_rehearsal._honour_use_cpu_in_training_arguments``: transformers (<= 5.23) refuses ``bf16=True`` without a
  GPU unless ``use_cpu=True``, and ignores accelerate's ``use_cpu: true``; only inside a CPU FSDP launch.
"""
