"""What both of our trainer classes add to their upstream base: the callback, FSDP-safe saving, crash-safe
checkpoints, and resuming from adapter-only checkpoints."""

from __future__ import annotations

import logging
import os
import shutil

import torch

from .._logging import human_size
from .callbacks import FSDPQLoRACallback
from .checkpoint import (
    ADAPTER_WEIGHTS,
    OPTIMIZER_STATE,
    directory_size,
    gather_optimizer_state,
    load_adapter_into,
    load_optimizer_state,
    save_adapter,
    save_full_model,
    unwrap_peft_model,
)
from .compile import enable_layer_compilation
from .consistency import keep_trainable_in_training_dtype
from .hygiene import DistinctBatchesCallback, LabelsCheckCallback, MemoryThroughputCallback
from .offload import install_activation_offloading
from .preemption import exit_after_preemption, resolve_resume
from .preemption_callback import PreemptionCallback, _EvaluationStopped

logger = logging.getLogger(__name__)

TRAINING_ARGS_NAME = "training_args.bin"
# Checkpoints are written under this hidden folder of the run directory and renamed into place when
# complete. Its name never matches transformers' ^checkpoint-\d+$ pattern, so `resume_from_checkpoint=True`
# cannot pick a half-written one.
STAGING_DIR = ".incomplete-checkpoints"


def with_fsdp_callback(callbacks, args=None):
    """Our callbacks first, then the user's (skipping kinds the user already added).

    The FSDP consistency callback and the all-labels-masked check always; the distinct-batches check and the
    memory/throughput log unless `args` (FSDPQLoRATrainingArguments) turns them off.
    """
    callbacks = list(callbacks or [])

    def has(kind):
        return any(isinstance(cb, kind) or cb is kind for cb in callbacks)

    ours = [] if has(FSDPQLoRACallback) else [FSDPQLoRACallback()]
    steps = getattr(args, "check_distinct_batches", 2)
    if steps and not has(DistinctBatchesCallback):
        ours.append(DistinctBatchesCallback(check_steps=steps))
    if getattr(args, "log_memory_throughput", True) and not has(MemoryThroughputCallback):
        ours.append(MemoryThroughputCallback())
    if not has(LabelsCheckCallback):
        ours.append(LabelsCheckCallback())
    if not has(PreemptionCallback):
        ours.append(PreemptionCallback())
    return ours + callbacks


def _set_trainer_checkpointing(args, value: bool) -> None:
    # `gradient_checkpointing` is transformers 5's deprecated alias of `activation_checkpointing`; trl reads both.
    args.activation_checkpointing = value
    if hasattr(args, "gradient_checkpointing"):
        args.gradient_checkpointing = value


def _trainer_checkpointing(args) -> bool:
    # transformers 5.17 (our floor) has only `gradient_checkpointing`; later 5.x add `activation_checkpointing`.
    value = getattr(args, "activation_checkpointing", None)
    return bool(getattr(args, "gradient_checkpointing", False) if value is None else value)


def resolve_activation_checkpointing(trainer) -> str:
    """Apply activation checkpointing exactly once, and say which in one line. Returns "fsdp", "trainer",
    "model" or "none".

    Three switches can each turn it on: FSDP's own (``fsdp_activation_checkpointing``, which wraps every
    transformer layer), the Trainer's ``activation_checkpointing``/``gradient_checkpointing`` (trl's configs
    default to True) and the model's own (``load_qlora_model`` and ``prepare_model_for_kbit_training`` enable it).
    With two on, transformers raises, or each layer's forward runs three times per step. FSDP's own is kept when
    the accelerate config asks for it (transformers' advice under FSDP: the Trainer's adds a redundant all-gather
    in backward); the others are turned off.
    """
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None) if trainer.is_fsdp_enabled else None
    model = trainer.model
    # transformers 5 names it is_activation_checkpointing; reading the old alias there warns (FutureWarning)
    if hasattr(model, "is_activation_checkpointing"):
        model_on = bool(model.is_activation_checkpointing)
    else:
        model_on = bool(getattr(model, "is_gradient_checkpointing", False))
    trainer_on = _trainer_checkpointing(trainer.args)
    if plugin is not None and plugin.activation_checkpointing:
        off = []
        if trainer_on:
            _set_trainer_checkpointing(trainer.args, False)
            off.append("TrainingArguments.gradient_checkpointing=True")
        if model_on:
            disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
            disable()
            off.append("the model's gradient checkpointing")
        logger.info(
            "hf_fsdp_qlora: activation checkpointing: FSDP's own (fsdp_activation_checkpointing: true), once per "
            "layer%s",
            f"; turned off {' and '.join(off)} so it is not applied twice" if off else "",
        )
        return "fsdp"
    if trainer_on or model_on:
        logger.info(
            "hf_fsdp_qlora: activation checkpointing: %s",
            "TrainingArguments.gradient_checkpointing=True" if trainer_on else "the model's gradient checkpointing",
        )
        return "trainer" if trainer_on else "model"
    logger.info("hf_fsdp_qlora: activation checkpointing: off")
    return "none"


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class FSDPSaveMixin:
    """Adapter-only, gathered, crash-safe saving for FSDP-wrapped peft models, and the matching resume."""

    _staging = False

    @property
    def fsdp_callback(self) -> FSDPQLoRACallback | None:
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, FSDPQLoRACallback):
                return cb
        return None

    def _saves_adapter_only(self) -> bool:
        return bool(getattr(self, "is_fsdp_enabled", False)) and unwrap_peft_model(self.model) is not None

    def create_accelerator_and_postprocess(self):
        # transformers refuses save_only_model with SHARDED_STATE_DICT because its FSDP model save needs the
        # sharded format; ours writes the gathered adapter, so the combination is fine and is how a user
        # turns optimizer state off in checkpoints.
        save_only_model = self.args.save_only_model
        if save_only_model and self.args.load_best_model_at_end:
            raise ValueError("save_only_model=True cannot be combined with load_best_model_at_end=True under FSDP.")
        # transformers also refuses FSDP's activation checkpointing together with the Trainer's, which trl's
        # configs turn on by default: the choice is made after the plugin exists (resolve_activation_checkpointing).
        wants_checkpointing = _trainer_checkpointing(self.args)
        self.args.save_only_model = False
        _set_trainer_checkpointing(self.args, False)
        try:
            super().create_accelerator_and_postprocess()
        finally:
            self.args.save_only_model = save_only_model
            _set_trainer_checkpointing(self.args, wants_checkpointing)
        resolve_activation_checkpointing(self)
        enable_layer_compilation(self)  # before prepare(), where accelerate compiles
        if getattr(self.args, "activation_offloading", False):
            install_activation_offloading(self.model)
        self._follow_wrapping()

    def _follow_wrapping(self) -> None:
        """Run our after-wrap fix-ups the moment accelerate wraps the model - before a resume loads weights into it
        or an evaluation runs it (either would start FSDP's lazy initialisation with the wrong dtypes)."""
        if not getattr(self, "is_fsdp_enabled", False):
            return
        accelerator, prepare_model = self.accelerator, self.accelerator.prepare_model

        def prepare_model_then_fix(model, *args, **kwargs):
            wrapped = prepare_model(model, *args, **kwargs)
            callback = self.fsdp_callback
            report = getattr(callback, "report", None)
            if report is not None and report.fsdp_version == 1:
                keep_trainable_in_training_dtype(wrapped, report.adapter_dtype)
            return wrapped

        # An instance attribute: only this trainer's accelerator is affected.
        accelerator.prepare_model = prepare_model_then_fix

    @property
    def preemption_callback(self) -> PreemptionCallback | None:
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, PreemptionCallback)), None)

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        # auto_resume: the latest complete checkpoint in output_dir; a preempted run exits after train() has
        # returned, so every callback's on_train_end (trackers) has run.
        resume_from_checkpoint = resolve_resume(self.args, resume_from_checkpoint)
        preemption = self.preemption_callback
        if preemption is not None:
            preemption.exit_deferred = True
        try:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            if preemption is not None:
                preemption.disarm()  # also when training raised: the user's handlers come back
        if preemption is not None and preemption.stopped and preemption.exit_code is not None:
            exit_after_preemption(preemption.exit_code)
        return output

    def _finalize_training(self, trial, num_train_samples, start_time):
        # After a preemption stop, upstream would load the best model inside the kill-grace window and, with
        # save_total_limit=1, delete every checkpoint but the best - the preemption checkpoint too. Neither runs.
        preemption = self.preemption_callback
        if preemption is None or not preemption.stopped:
            return super()._finalize_training(trial, num_train_samples, start_time)
        load_best, limit = self.args.load_best_model_at_end, self.args.save_total_limit
        self.args.load_best_model_at_end, self.args.save_total_limit = False, None
        try:
            return super()._finalize_training(trial, num_train_samples, start_time)
        finally:
            self.args.load_best_model_at_end, self.args.save_total_limit = load_best, limit

    def evaluate(self, *args, **kwargs):
        preemption = self.preemption_callback
        if preemption is not None and preemption.stopped and preemption.flag is not None:
            return {}  # the next dataset of a dict eval_dataset, after a stop: the checkpoint comes first
        try:
            return super().evaluate(*args, **kwargs)
        except _EvaluationStopped:  # every rank stopped at the same batch to checkpoint (preemption)
            return {}

    def evaluation_loop(self, *args, **kwargs):
        # evaluate()/predict() before train(): wrap the model as train() would (upstream FSDP2 raises, FSDP1's next
        # train() fails). Collective; does nothing once the model is wrapped.
        from .generation import prepare_for_evaluation

        prepare_for_evaluation(self)
        return super().evaluation_loop(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The chunked loss where the trainer keeps transformers' stock one (see hf_fsdp_qlora.train.loss).
        from .loss import compute_loss

        return compute_loss(self, super().compute_loss, model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # A loss-only evaluation takes the chunked loss; predict() / compute_metrics get the model's logits.
        self.hf_fsdp_qlora_loss_only = bool(prediction_loss_only)
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        finally:
            self.hf_fsdp_qlora_loss_only = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        if not getattr(self, "is_fsdp_enabled", False):
            return super().save_model(output_dir, _internal_call=_internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        # Collective: every rank takes part in the gather; only the main process writes.
        if self._saves_adapter_only():
            save_adapter(self.model, output_dir, is_main_process=self.args.should_save)
        elif _internal_call and "SHARDED" in str(self.accelerator.state.fsdp_plugin.state_dict_type):
            # A full fine-tune's checkpoint in sharded form: upstream writes it with the optimizer state
            # (pytorch_model_fsdp_0/, each rank its shard) and resumes from it.
            return super().save_model(output_dir, _internal_call=_internal_call)
        else:
            save_full_model(self.model, output_dir, is_main_process=self.args.should_save)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        _barrier()

    def _get_output_dir(self, trial):
        run_dir = super()._get_output_dir(trial=trial)
        return os.path.join(run_dir, STAGING_DIR) if self._staging else run_dir

    def _save_checkpoint(self, model, trial):
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staged, final = os.path.join(run_dir, STAGING_DIR, name), os.path.join(run_dir, name)
        if self.args.should_save and os.path.exists(staged):  # left by a run killed mid-save
            shutil.rmtree(staged)
        _barrier()
        self._staging = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = False
        _barrier()  # every rank has finished writing its part (sharded optimizer state)
        if self.args.should_save:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(staged, final)
            try:  # leave no empty staging folder behind in the user's output folder
                os.rmdir(os.path.join(run_dir, STAGING_DIR))
            except OSError:
                pass
            if self.state.best_model_checkpoint == staged:
                self.state.best_model_checkpoint = final
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
            )
            self._log_checkpoint(final)
        _barrier()

    def _gathers_optimizer(self) -> bool:
        # Adapter runs always; a full fine-tune when it checkpoints in full form (FULL_STATE_DICT). Sharded
        # full fine-tunes keep upstream's per-rank model + optimizer shards, which resume exactly.
        if not getattr(self, "is_fsdp_enabled", False):
            return False
        sharded = "SHARDED" in str(self.accelerator.state.fsdp_plugin.state_dict_type)
        return self._saves_adapter_only() or not sharded

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._gathers_optimizer():
            return super()._save_optimizer_and_scheduler(output_dir)
        from transformers.trainer import SCHEDULER_NAME

        # Upstream writes an FSDP model state here (empty for an adapter run under FSDP2; a segfault for
        # FSDP1 on CPU ranks; a second copy of the model save_model already wrote) and an optimizer state
        # that, loaded back into FSDP1 with use_orig_params, aliased exp_avg to exp_avg_sq (the resumed run
        # diverged after one step). The optimizer state is gathered whole by parameter name instead (small
        # for an adapter) and written by the main process.
        state = gather_optimizer_state(self.model, self.optimizer)
        if self.args.should_save:
            torch.save(state, os.path.join(output_dir, OPTIMIZER_STATE))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint):
        path = os.path.join(checkpoint, OPTIMIZER_STATE) if checkpoint is not None else None
        if path is None or not self._gathers_optimizer() or not os.path.isfile(path):
            return super()._load_optimizer_and_scheduler(checkpoint)
        from transformers.trainer import SCHEDULER_NAME

        load_optimizer_state(self.model, self.optimizer, torch.load(path, map_location="cpu", weights_only=True))
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _log_checkpoint(self, path: str) -> None:
        total = directory_size(path)
        adapter_file = os.path.join(path, ADAPTER_WEIGHTS)
        model_bytes = os.path.getsize(adapter_file) if os.path.isfile(adapter_file) else None
        if model_bytes is None:  # a full fine-tune: everything but optimizer/scheduler/RNG/state is the model
            other = [f for f in os.listdir(path) if f.startswith(("optimizer", "scheduler", "rng_state", "trainer_"))]
            model_bytes = total - sum(directory_size(os.path.join(path, f)) if os.path.isdir(os.path.join(path, f))
                                      else os.path.getsize(os.path.join(path, f)) for f in other)  # fmt: skip
        kind = "adapter" if os.path.isfile(adapter_file) else "model"
        rest = "off (save_only_model=True)" if self.args.save_only_model else human_size(total - model_bytes)
        logger.warning(
            "hf_fsdp_qlora: checkpoint %s written: %s in all - %s %s, optimizer/scheduler/RNG/state %s",
            path,
            human_size(total),
            kind,
            human_size(model_bytes),
            rest,
        )

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        has_adapter = os.path.isfile(os.path.join(resume_from_checkpoint, ADAPTER_WEIGHTS))
        if not (self._saves_adapter_only() and has_adapter):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # Our checkpoints hold the gathered adapter, not an FSDP model state: load it into the wrapped model.
        count = load_adapter_into(model if model is not None else self.model, resume_from_checkpoint)
        logger.info("hf_fsdp_qlora: resumed %d adapter tensors from %s", count, resume_from_checkpoint)
