"""Long context for our trainers: the trainer hooks of sequence parallelism and tiled MLP, in one place.

The work is done by :mod:`hf_fsdp_qlora.train.sequence_parallel` (with :mod:`hf_fsdp_qlora.train.ulysses`) and
:mod:`hf_fsdp_qlora.train.tiled_mlp`; this module only reads the training arguments and hands over.
"""

from __future__ import annotations

from . import router_aux, sequence_parallel, sp_outputs, ulysses
from .tiled_mlp import install_tiled_mlp

__all__ = [
    "compute_loss",
    "evaluation_loop",
    "install_long_context",
    "prediction_step",
    "track_num_input_tokens",
    "train_dataloader",
]


def install_long_context(trainer) -> None:
    """Before accelerate wraps the model: sequence parallelism's checks, groups and attention; the tiled MLP."""
    args = trainer.args
    sequence_parallel.setup_sequence_parallel(trainer)
    if getattr(args, "tiled_mlp", False):
        install_tiled_mlp(trainer.model, int(getattr(args, "tiled_mlp_tokens", 1024)))


def train_dataloader(trainer, stock):
    """The stock train dataloader, sharded by sequence-parallel group instead of by rank under sp_size > 1."""
    return sequence_parallel.shard_by_group(stock(), sequence_parallel.sp_size_of(trainer.args))


def evaluation_loop(trainer, stock, dataloader, *args, **kwargs):
    """The stock evaluation loop; under sp_size > 1 its dataloader sharded by group and its gather keeping one rank
    per group (sp_outputs.group_gather: each group's ranks return the group's whole loss and outputs). Set per call:
    the Trainer resets its gather_function at the end of every evaluation loop."""
    sp_size = sequence_parallel.sp_size_of(trainer.args)
    if sp_size > 1 and ulysses.active_group() is not None:
        trainer.gather_function = sp_outputs.group_gather(trainer)
    return stock(sequence_parallel.shard_by_group(dataloader, sp_size), *args, **kwargs)


def prediction_step(trainer, stock, model, inputs, prediction_loss_only, ignore_keys=None):
    """The stock prediction step; under sp_size > 1, the group's whole loss and outputs (sp_outputs)."""
    setting = sequence_parallel.setting_name(sequence_parallel.sp_size_of(trainer.args))
    return sp_outputs.prediction_step(
        trainer, stock, model, inputs, prediction_loss_only, ignore_keys=ignore_keys, setting=setting
    )


def track_num_input_tokens(trainer, stock, inputs) -> None:
    """The Trainer's ``num_input_tokens_seen`` count (`stock`: the sum over every rank of its batch's tokens); under
    sp_size > 1 a group's ranks share each batch, so the sum counts it sp_size times: what it added is divided by
    sp_size (the count one process, or one rank per group, makes)."""
    sp_size = sequence_parallel.sp_size_of(trainer.args)
    before = trainer.state.num_input_tokens_seen
    stock(inputs)
    if sp_size > 1:
        trainer.state.num_input_tokens_seen = before + (trainer.state.num_input_tokens_seen - before) // sp_size


def compute_loss(trainer, stock, model, inputs, return_outputs=False, num_items_in_batch=None):
    """This rank's share of each sequence (sp_size > 1) through the chunked loss (or `stock`)."""
    from . import loss

    def inner(model, inputs, return_outputs=False, num_items_in_batch=None):
        return loss.compute_loss(trainer, stock, model, inputs, return_outputs, num_items_in_batch)

    if sequence_parallel.sp_size_of(trainer.args) <= 1:
        with router_aux.unscaled_router_aux(trainer, model, num_items_in_batch):
            return inner(model, inputs, return_outputs, num_items_in_batch)
    return sequence_parallel.compute_loss(trainer, inner, model, inputs, return_outputs, num_items_in_batch)
