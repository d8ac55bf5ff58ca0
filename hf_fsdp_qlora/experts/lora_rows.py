"""Expert LoRA, one routed expert's rows at a time: peft's ``lora_A`` / ``lora_B`` of a fused 3-D expert weight,
read per expert, applied to the rows routed to it (the per-expert loop of
:class:`~hf_fsdp_qlora.experts.quantized.QuantizedExperts`; the grouped path is :mod:`.grouped`)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["run_with_weight"]


def run_with_weight(linear: nn.Module, fn, *args):
    """``fn(linear.weight, *args)`` run as `linear`'s forward, so FSDP (an FSDP1 unit around `linear`) gathers the
    weight first. Outside its own unit's forward an FSDP1 weight is a 1-D flat shard, which is why peft's own
    expert LoRA fails under FSDP1 (``shape '[8, -1, 2048]' is invalid``)."""
    inner = getattr(linear, "_fsdp_wrapped_module", linear)
    inner.forward = lambda *a: fn(inner.weight, *a)  # an instance attribute shadows Linear.forward, for this call
    try:
        return linear(*args)
    finally:
        del inner.forward


def _lora_A_rows(weight, x, experts, counts, num_experts):
    # peft's lora_A for [E, out, in] is [r*E, in]: expert e's rows are e*r .. e*r+r-1.
    per_expert = weight.unflatten(0, (num_experts, -1))
    x = x.to(weight.dtype)
    return torch.cat([c @ per_expert[e].T for c, e in zip(x.split(counts), experts)])


def _lora_B_rows(weight, low, experts, counts, num_experts):
    # peft's lora_B is [out, r*E] read as [out, r, E]: expert e's columns are e, E+e, 2E+e, ...
    per_expert = weight.unflatten(1, (-1, num_experts))
    low = low.to(weight.dtype)
    return torch.cat([c @ per_expert[:, :, e].T for c, e in zip(low.split(counts), experts)])


def _lora_B_rows_stored(weight, x, experts, counts, num_experts):
    # lora_B [in, r*E] of a weight peft reads as stored: expert e's columns e, E+e, ... multiply x from the right.
    per_expert = weight.unflatten(1, (-1, num_experts))
    x = x.to(weight.dtype)
    return torch.cat([c @ per_expert[:, :, e] for c, e in zip(x.split(counts), experts)])


def _lora_A_rows_stored(weight, low, experts, counts, num_experts):
    # lora_A [r*E, out]: expert e's rows e*r .. e*r+r-1.
    per_expert = weight.unflatten(0, (num_experts, -1))
    low = low.to(weight.dtype)
    return torch.cat([c @ per_expert[e] for c, e in zip(low.split(counts), experts)])
