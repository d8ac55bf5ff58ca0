"""The random draws of a forward under sequence parallelism (dropout masks, NEFTune's noise), drawn as one process
draws them for the whole sequence: each rank of a group from a stream of its own, and NEFTune's noise at the whole
sequence's scale. One process's draws cannot be reproduced bit for bit (they are laid out over the whole sequence);
their distribution is.
"""

from __future__ import annotations

import contextlib
import math

import torch

__all__ = ["forward_draws"]


@contextlib.contextmanager
def forward_draws(trainer, model, state):
    """Around one training forward of this rank's chunk (:func:`hf_fsdp_qlora.train.sequence_parallel.compute_loss`)."""
    if not model.training:
        yield
        return
    with _own_random_stream(state), _whole_sequence_neftune(trainer, model, state):
        yield


@contextlib.contextmanager
def _own_random_stream(state):
    """Each rank of the group draws the forward's random numbers (dropout masks: LoRA's, attention's; NEFTune's noise)
    from a stream of its own. One process draws them independently along the whole sequence; the group's ranks, seeded
    alike by the Trainer, would draw the same masks for their chunks. One draw from the shared generator (which keeps
    the group's ranks, and a resumed run, in step) seeds this rank's stream for this forward; activation checkpointing
    stashes that stream's state with the forward and recomputes with it."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) + state.sp_rank
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(seed)
        if devices:
            torch.cuda.manual_seed(seed)
        yield


def _neftune_embeddings(trainer, model):
    """The input embeddings transformers' NEFTune hook is on (where ``activate_neftune`` puts it), or None."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    causal = unwrapped.base_model.model if hasattr(unwrapped, "get_base_model") else unwrapped
    get = getattr(causal, "get_input_embeddings", None)
    embeddings = get() if get is not None else None
    return embeddings if getattr(embeddings, "neftune_noise_alpha", None) is not None else None


@contextlib.contextmanager
def _whole_sequence_neftune(trainer, model, state):
    """NEFTune bounds its noise by alpha / sqrt(tokens x hidden) of the embeddings it sees: this rank's chunk, where
    one process sees the whole sequence. For this forward its alpha is scaled by sqrt(chunk / length): the bound one
    process draws within."""
    alpha = getattr(trainer, "neftune_noise_alpha", None)
    embeddings = _neftune_embeddings(trainer, model) if alpha is not None else None
    if embeddings is None:
        yield
        return
    chunk = (state.length + (-state.length % state.sp_size)) // state.sp_size
    embeddings.neftune_noise_alpha = alpha * math.sqrt(chunk / state.length)
    try:
        yield
    finally:
        embeddings.neftune_noise_alpha = alpha
