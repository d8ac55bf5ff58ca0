"""A mixture of experts' router aux loss weighted as ``router_aux_loss_coef`` says, on any number of ranks.

With ``average_tokens_across_devices=True`` (the default), ``Trainer.compute_loss`` multiplies the model's loss by the
number of processes, because the cross-entropy was divided by the whole batch's token count and the gradient
all-reduce averages over ranks. A mixture of experts has already added ``router_aux_loss_coef x aux_loss`` (a mean
over this rank's tokens) to that loss, so the aux term is multiplied too: on N ranks its weight is N times the
configured coefficient (transformers issue #48690, open; PRs #48691 and #48706). Here, for the one call of the
model inside the Trainer's ``compute_loss``, a forward hook takes ``coef x aux_loss x (1 - 1/N)`` back out of the
model's loss, so after the Trainer's multiplication each rank adds the coefficient times its own aux loss and the
all-reduce averages them: the mean of the ranks' aux losses, what stock computes in one process per micro-batch.
Under sequence parallelism :mod:`hf_fsdp_qlora.train.sp_outputs` does the same with the whole sequence's aux loss.
"""

from __future__ import annotations

import contextlib

__all__ = ["trainer_loss_scale", "unscaled_router_aux"]


def trainer_loss_scale(trainer, num_items_in_batch) -> int:
    """What ``Trainer.compute_loss`` multiplies the model's loss by (its own condition, transformers 5.x)."""
    args = trainer.args
    if not (args.average_tokens_across_devices and num_items_in_batch is not None):
        return 1
    if not (getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None)):
        return 1
    tp = trainer.get_tp_size() if hasattr(trainer, "get_tp_size") else 1
    scale = trainer.accelerator.num_processes // max(tp, 1)
    return scale if args.n_gpu <= 1 else args.n_gpu


def _causal_lm(model):
    from .checkpoint import unwrap_peft_model

    inner = unwrap_peft_model(model) or model
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def _coefficient(model) -> float | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    coef = getattr(model, "router_aux_loss_coef", None)
    return coef if coef is not None else getattr(config, "router_aux_loss_coef", None)


@contextlib.contextmanager
def unscaled_router_aux(trainer, model, num_items_in_batch):
    """Around one ``Trainer.compute_loss`` call: the model's router aux loss kept at its coefficient (see above)."""
    scale = trainer_loss_scale(trainer, num_items_in_batch)
    causal = _causal_lm(model) if scale > 1 else None
    coef = _coefficient(causal) if causal is not None else None
    if not coef:
        yield
        return

    def after_forward(module, args, output):
        aux, loss = getattr(output, "aux_loss", None), getattr(output, "loss", None)
        if aux is not None and loss is not None and hasattr(output, "keys"):
            output.loss = loss - coef * (1.0 - 1.0 / scale) * aux.to(loss.device, loss.dtype)
        return output

    handle = causal.register_forward_hook(after_forward)
    try:
        yield
    finally:
        handle.remove()
