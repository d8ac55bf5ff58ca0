"""The Trainer's save and resume hooks under FSDP: gathered model saves, crash-safe (staged) checkpoints, the
gathered optimizer state and the adapter-only resume.

:class:`~hf_fsdp_qlora.train._trainer_mixin.FSDPSaveMixin` delegates each overridden Trainer method here, handing
over the stock method it overrides (``stock``) for the cases upstream handles itself.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from .._logging import human_size
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

__all__ = [
    "STAGING_DIR",
    "TRAINING_ARGS_NAME",
    "load_from_checkpoint",
    "load_optimizer_and_scheduler",
    "save_checkpoint",
    "save_model",
    "save_optimizer_and_scheduler",
    "staged_output_dir",
]

logger = logging.getLogger(__name__)

TRAINING_ARGS_NAME = "training_args.bin"
# Checkpoints are written under this hidden folder of the run directory and renamed into place when
# complete. Its name never matches transformers' ^checkpoint-\d+$ pattern, so `resume_from_checkpoint=True`
# cannot pick a half-written one.
STAGING_DIR = ".incomplete-checkpoints"


def _barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _fsdp(trainer) -> bool:
    return bool(getattr(trainer, "is_fsdp_enabled", False))


def _sharded(trainer) -> bool:
    return "SHARDED" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def saves_adapter_only(trainer) -> bool:
    return _fsdp(trainer) and unwrap_peft_model(trainer.model) is not None


def save_model(trainer, stock, output_dir: str | None, _internal_call: bool):
    """`Trainer.save_model` under FSDP: the gathered adapter (or full model), written by the main process."""
    if not _fsdp(trainer):
        return stock(output_dir, _internal_call=_internal_call)
    output_dir = output_dir if output_dir is not None else trainer.args.output_dir
    # Collective: every rank takes part in the gather; only the main process writes.
    if saves_adapter_only(trainer):
        save_adapter(trainer.model, output_dir, is_main_process=trainer.args.should_save)
    elif _internal_call and _sharded(trainer):
        # A full fine-tune's checkpoint in sharded form: upstream writes it with the optimizer state
        # (pytorch_model_fsdp_0/, each rank its shard) and resumes from it.
        return stock(output_dir, _internal_call=_internal_call)
    else:
        save_full_model(trainer.model, output_dir, is_main_process=trainer.args.should_save)
    if trainer.args.should_save:
        if trainer.processing_class is not None:
            trainer.processing_class.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
    _barrier()


def staged_output_dir(trainer, run_dir: str) -> str:
    """`Trainer._get_output_dir`: the staging folder while a checkpoint is being written."""
    return os.path.join(run_dir, STAGING_DIR) if getattr(trainer, "hf_fsdp_qlora_staging", False) else run_dir


def save_checkpoint(trainer, stock, model, trial) -> None:
    """`Trainer._save_checkpoint`, crash-safe: written under STAGING_DIR, renamed into place when complete."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    run_dir = trainer._get_output_dir(trial=trial)
    name = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    staged, final = os.path.join(run_dir, STAGING_DIR, name), os.path.join(run_dir, name)
    if trainer.args.should_save and os.path.exists(staged):  # left by a run killed mid-save
        shutil.rmtree(staged)
    _barrier()
    trainer.hf_fsdp_qlora_staging = True
    try:
        stock(model, trial)
    finally:
        trainer.hf_fsdp_qlora_staging = False
    _barrier()  # every rank has finished writing its part (sharded optimizer state)
    if trainer.args.should_save:
        _move_into_place(trainer, run_dir, staged, final)
    _barrier()


def _move_into_place(trainer, run_dir: str, staged: str, final: str) -> None:
    from transformers.trainer_utils import rotate_checkpoints

    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(staged, final)
    try:  # leave no empty staging folder behind in the user's output folder
        os.rmdir(os.path.join(run_dir, STAGING_DIR))
    except OSError:
        pass
    if trainer.state.best_model_checkpoint == staged:
        trainer.state.best_model_checkpoint = final
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=_kept_checkpoints(trainer.args),
        best_model_checkpoint=trainer.state.best_model_checkpoint,
    )
    _log_checkpoint(trainer, final)


def _kept_checkpoints(args) -> int | None:
    """How many checkpoints rotation keeps: ``save_total_limit``; with no checkpointing asked for
    (``save_strategy="no"``), the only checkpoints are preemption ones, and the latest is all a resume needs (one per
    requeue piled up before)."""
    strategy = getattr(args.save_strategy, "value", args.save_strategy)
    return 1 if strategy == "no" else args.save_total_limit


def _gathers_optimizer(trainer) -> bool:
    # Adapter runs always; a full fine-tune when it checkpoints in full form (FULL_STATE_DICT). Sharded
    # full fine-tunes keep upstream's per-rank model + optimizer shards, which resume exactly.
    if not _fsdp(trainer):
        return False
    return saves_adapter_only(trainer) or not _sharded(trainer)


def save_optimizer_and_scheduler(trainer, stock, output_dir: str) -> None:
    """`Trainer._save_optimizer_and_scheduler`: the optimizer state gathered by parameter name."""
    if not _gathers_optimizer(trainer):
        return stock(output_dir)
    from transformers.trainer import SCHEDULER_NAME

    # Upstream writes an FSDP model state here (empty for an adapter run under FSDP2; a segfault for
    # FSDP1 on CPU ranks; a second copy of the model save_model already wrote) and an optimizer state
    # that, loaded back into FSDP1 with use_orig_params, aliased exp_avg to exp_avg_sq (the resumed run
    # diverged after one step). The optimizer state is gathered whole by parameter name instead (small
    # for an adapter) and written by the main process.
    state = gather_optimizer_state(trainer.model, trainer.optimizer)
    if trainer.args.should_save:
        torch.save(state, os.path.join(output_dir, OPTIMIZER_STATE))
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_optimizer_and_scheduler(trainer, stock, checkpoint) -> None:
    """`Trainer._load_optimizer_and_scheduler`: the gathered optimizer state, when the checkpoint has one."""
    path = os.path.join(checkpoint, OPTIMIZER_STATE) if checkpoint is not None else None
    if path is None or not _gathers_optimizer(trainer) or not os.path.isfile(path):
        return stock(checkpoint)
    from transformers.trainer import SCHEDULER_NAME

    load_optimizer_state(trainer.model, trainer.optimizer, torch.load(path, map_location="cpu", weights_only=True))
    trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


def _log_checkpoint(trainer, path: str) -> None:
    total = directory_size(path)
    adapter_file = os.path.join(path, ADAPTER_WEIGHTS)
    model_bytes = os.path.getsize(adapter_file) if os.path.isfile(adapter_file) else None
    if model_bytes is None:  # a full fine-tune: everything but optimizer/scheduler/RNG/state is the model
        other = [f for f in os.listdir(path) if f.startswith(("optimizer", "scheduler", "rng_state", "trainer_"))]
        model_bytes = total - sum(directory_size(os.path.join(path, f)) if os.path.isdir(os.path.join(path, f))
                                  else os.path.getsize(os.path.join(path, f)) for f in other)  # fmt: skip
    kind = "adapter" if os.path.isfile(adapter_file) else "model"
    rest = "off (save_only_model=True)" if trainer.args.save_only_model else human_size(total - model_bytes)
    logger.warning(
        "hf_fsdp_qlora: checkpoint %s written: %s in all - %s %s, optimizer/scheduler/RNG/state %s",
        path,
        human_size(total),
        kind,
        human_size(model_bytes),
        rest,
    )


def load_from_checkpoint(trainer, stock, resume_from_checkpoint, model=None):
    """`Trainer._load_from_checkpoint`: an adapter-only checkpoint is loaded into the wrapped model."""
    has_adapter = os.path.isfile(os.path.join(resume_from_checkpoint, ADAPTER_WEIGHTS))
    if not (saves_adapter_only(trainer) and has_adapter):
        return stock(resume_from_checkpoint, model)
    # Our checkpoints hold the gathered adapter, not an FSDP model state: load it into the wrapped model.
    count = load_adapter_into(model if model is not None else trainer.model, resume_from_checkpoint)
    logger.info("hf_fsdp_qlora: resumed %d adapter tensors from %s", count, resume_from_checkpoint)
