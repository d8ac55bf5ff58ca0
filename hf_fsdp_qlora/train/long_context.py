"""Long context for our trainers: the trainer hooks of sequence parallelism and tiled MLP, in one place.

The work is done by :mod:`hf_fsdp_qlora.train.sequence_parallel` (with :mod:`hf_fsdp_qlora.train.ulysses`) and
:mod:`hf_fsdp_qlora.train.tiled_mlp`; this module only reads the training arguments and hands over.
"""

from __future__ import annotations

from . import sequence_parallel
from .tiled_mlp import install_tiled_mlp

__all__ = ["compute_loss", "eval_dataloader", "install_long_context", "train_dataloader"]


def install_long_context(trainer) -> None:
    """Before accelerate wraps the model: sequence parallelism's checks, groups and attention; the tiled MLP."""
    args = trainer.args
    sequence_parallel.setup_sequence_parallel(trainer)
    if getattr(args, "tiled_mlp", False):
        install_tiled_mlp(trainer.model, int(getattr(args, "tiled_mlp_tokens", 1024)))


def train_dataloader(trainer, stock):
    """The stock train dataloader, sharded by sequence-parallel group instead of by rank under sp_size > 1."""
    return sequence_parallel.shard_by_group(stock(), sequence_parallel.sp_size_of(trainer.args))


def eval_dataloader(trainer, loader):
    """The evaluation dataloader, sharded by sequence-parallel group under sp_size > 1 (the loss is then each
    group's: the Trainer's mean over every rank's partial loss is the mean over groups)."""
    return sequence_parallel.shard_by_group(loader, sequence_parallel.sp_size_of(trainer.args))


def compute_loss(trainer, stock, model, inputs, return_outputs=False, num_items_in_batch=None):
    """This rank's share of each sequence (sp_size > 1) through the chunked loss (or `stock`)."""
    from . import loss

    def inner(model, inputs, return_outputs=False, num_items_in_batch=None):
        return loss.compute_loss(trainer, stock, model, inputs, return_outputs, num_items_in_batch)

    if sequence_parallel.sp_size_of(trainer.args) <= 1:
        return inner(model, inputs, return_outputs, num_items_in_batch)
    return sequence_parallel.compute_loss(trainer, inner, model, inputs, return_outputs, num_items_in_batch)
