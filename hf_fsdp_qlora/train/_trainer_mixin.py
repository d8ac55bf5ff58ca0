"""What both of our trainer classes add to their upstream base: the callbacks, and a table of Trainer hooks.

Each hook is a few lines that hand the stock method to the module of ``train/`` owning that concern:

==================================== ===================================================================
Trainer hook                         owner
==================================== ===================================================================
create_accelerator_and_postprocess   accelerator_setup (settings set aside, activation checkpointing),
                                     backbone (trl's fused LM head finds the text backbone: Llama 4, Mllama),
                                     compile, offload, long_context (sequence parallelism, tiled MLP),
                                     consistency.follow_wrapping (after-wrap fix-ups),
                                     vllm_sync (trl's GRPO/RLOO with use_vllm: adapter-only sync)
get_train_dataloader, compute_loss   long_context (a sequence-parallel group's ranks share batches and split
                                     each sequence; then loss.compute_loss, the chunked loss)
_track_num_input_tokens              long_context (a group's shared batches counted once)
train                                preemption_callback (auto_resume, the exit after a stop)
_finalize_training                   preemption_callback (no best-model load or rotation after a stop)
evaluate                             preemption_callback (an evaluation a stop ended has no metrics)
evaluation_loop                      generation.prepare_for_evaluation (evaluate() before train()),
                                     long_context (the eval batches shared by a sequence-parallel group,
                                     one rank per group gathered)
prediction_step                      loss.loss_only_prediction, long_context (a sequence-parallel group's
                                     whole loss and outputs)
save_model                           checkpoint_hooks.save_model (the gathered adapter)
_get_output_dir, _save_checkpoint    checkpoint_hooks (staged, crash-safe checkpoints)
_save_optimizer_and_scheduler        checkpoint_hooks (the gathered optimizer state)
_load_optimizer_and_scheduler        checkpoint_hooks
_load_from_checkpoint                checkpoint_hooks (resume from an adapter-only checkpoint)
==================================== ===================================================================

A new concern adds a row: a hook here and the module that owns it.
"""

from __future__ import annotations

from . import checkpoint_hooks
from .accelerator_setup import resolve_activation_checkpointing, set_aside_refused_settings
from .backbone import expose_text_backbone
from .callbacks import FSDPQLoRACallback
from .compile import enable_layer_compilation
from .consistency import follow_wrapping
from .hygiene import DistinctBatchesCallback, LabelsCheckCallback, MemoryThroughputCallback
from .long_context import install_long_context
from .offload import install_activation_offloading
from .preemption_callback import (
    PreemptionCallback,
    evaluate_unless_stopped,
    finalize_training,
    preemption_callback_of,
    train_then_exit_if_preempted,
)
from .vllm_sync import prepare_adapter_sync


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
    if getattr(args, "sp_size", 1) > 1:
        steps = 0  # the ranks of a sequence-parallel group share batches by design (train/sequence_parallel.py)
    if steps and not has(DistinctBatchesCallback):
        ours.append(DistinctBatchesCallback(check_steps=steps))
    if getattr(args, "log_memory_throughput", True) and not has(MemoryThroughputCallback):
        ours.append(MemoryThroughputCallback())
    if not has(LabelsCheckCallback):
        ours.append(LabelsCheckCallback())
    if not has(PreemptionCallback):
        ours.append(PreemptionCallback())
    return ours + callbacks


class FSDPSaveMixin:
    """Adapter-only, gathered, crash-safe saving for FSDP-wrapped peft models, and the matching resume."""

    hf_fsdp_qlora_staging = False  # True while a checkpoint is written under checkpoint_hooks.STAGING_DIR

    @property
    def fsdp_callback(self) -> FSDPQLoRACallback | None:
        return next((cb for cb in self.callback_handler.callbacks if isinstance(cb, FSDPQLoRACallback)), None)

    @property
    def preemption_callback(self) -> PreemptionCallback | None:
        return preemption_callback_of(self)

    # -- the accelerator and the wrapped model

    def create_accelerator_and_postprocess(self):
        with set_aside_refused_settings(self.args):
            super().create_accelerator_and_postprocess()
        resolve_activation_checkpointing(self)
        # trl's SFTTrainer patches its fused LM head in after this returns; the head finds the backbone per call
        expose_text_backbone(self.model)
        enable_layer_compilation(self)  # before prepare(), where accelerate compiles
        if getattr(self.args, "activation_offloading", False):
            install_activation_offloading(self.model)
        install_long_context(self)  # before accelerate wraps the model
        follow_wrapping(self)
        # trl's GRPO/RLOO with use_vllm=True build their engine after this returns: mark the model for the
        # adapter-only sync before they do.
        prepare_adapter_sync(self)

    # -- the loop: preemption

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        return train_then_exit_if_preempted(self, super().train, resume_from_checkpoint, trial, **kwargs)

    def _finalize_training(self, trial, num_train_samples, start_time):
        return finalize_training(self, super()._finalize_training, trial, num_train_samples, start_time)

    # -- evaluation and the loss

    def evaluate(self, *args, **kwargs):
        return evaluate_unless_stopped(self, super().evaluate, *args, **kwargs)

    def evaluation_loop(self, dataloader, *args, **kwargs):
        # evaluate()/predict() before train(): wrap the model as train() would (upstream FSDP2 raises, FSDP1's next
        # train() fails). Collective; does nothing once the model is wrapped.
        from .generation import prepare_for_evaluation
        from .long_context import evaluation_loop

        prepare_for_evaluation(self)
        return evaluation_loop(self, super().evaluation_loop, dataloader, *args, **kwargs)

    def get_train_dataloader(self):
        from .long_context import train_dataloader

        return train_dataloader(self, super().get_train_dataloader)

    def _track_num_input_tokens(self, inputs):
        from .long_context import track_num_input_tokens

        return track_num_input_tokens(self, super()._track_num_input_tokens, inputs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The sequence split (under sp_size > 1), then the chunked loss where the trainer keeps transformers' stock one
        # (see hf_fsdp_qlora.train.loss).
        from .long_context import compute_loss

        return compute_loss(self, super().compute_loss, model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        from .long_context import prediction_step
        from .loss import loss_only_prediction

        def stock(model, inputs, prediction_loss_only, ignore_keys=None):
            with loss_only_prediction(self, prediction_loss_only):
                return super(FSDPSaveMixin, self).prediction_step(model, inputs, prediction_loss_only, ignore_keys)

        return prediction_step(self, stock, model, inputs, prediction_loss_only, ignore_keys=ignore_keys)

    # -- saving and resuming

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        return checkpoint_hooks.save_model(self, super().save_model, output_dir, _internal_call)

    def _get_output_dir(self, trial):
        return checkpoint_hooks.staged_output_dir(self, super()._get_output_dir(trial=trial))

    def _save_checkpoint(self, model, trial):
        checkpoint_hooks.save_checkpoint(self, super()._save_checkpoint, model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        return checkpoint_hooks.save_optimizer_and_scheduler(self, super()._save_optimizer_and_scheduler, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        return checkpoint_hooks.load_optimizer_and_scheduler(self, super()._load_optimizer_and_scheduler, checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        return checkpoint_hooks.load_from_checkpoint(
            self, super()._load_from_checkpoint, resume_from_checkpoint, model
        )
