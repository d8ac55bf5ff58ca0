"""DoRA (``LoraConfig(use_dora=True)``) under FSDP1: size DoRA's identity matrix from the layer, not its shard.

Under FSDP1, transformers installs peft's ``fsdp_auto_wrap_policy``, which makes every leaf module with a trainable
weight its own unit: each ``lora_A`` / ``lora_B`` Linear and each DoRA magnitude (``DoraLinearLayer``). DoRA's
forward computes ``B @ A`` by running ``lora_B(lora_A(eye))`` - through the modules' forwards precisely so FSDP
gathers them - but sizes ``eye`` from ``lora_A.weight.shape[1]``, read before ``lora_A`` runs. Outside its own
unit's forward, ``lora_A.weight`` is that rank's 1-D flat shard, so every rank fails in the first forward with
``IndexError: tuple index out of range`` (peft/tuners/lora/dora.py, ``get_lora_weight``).

The fix reads the width from ``lora_A.in_features`` (a plain attribute, whole on every rank) and keeps peft's
units. The alternative - one unit for the whole LoRA-wrapped Linear, or no separate LoRA units inside the decoder
layer - puts frozen 4-bit weights and trainable adapters in one FlatParameter, and FSDP1 (``use_orig_params=True``)
then keeps a gradient for the whole FlatParameter, frozen bytes included: a per-rank gradient the size of the
sharded base model. Reading the weights inside ``summon_full_params`` is no option either: FSDP1 refuses it
during forward and backward. Activation checkpointing recomputes the same forward, so it needs nothing more.
"""

from __future__ import annotations

import torch

__all__ = ["size_dora_identity_from_layer"]


def _lora_weight(lora_A, lora_B, adapter_name=None):
    """peft's ``DoraLinearLayer.get_lora_weight`` with the identity sized by ``lora_A.in_features``."""
    shard = lora_A.weight  # device and dtype only: a flat shard has the whole weight's
    eye = torch.eye(lora_A.in_features, device=shard.device, dtype=shard.dtype)
    return lora_B(lora_A(eye)).T


def size_dora_identity_from_layer(model) -> int:
    """Give every DoRA Linear layer of `model` a ``get_lora_weight`` that works when ``lora_A`` is its own FSDP1
    unit. Set on the layer objects (instance attributes), not on peft's class: only this model changes.

    Returns:
        How many DoRA layers were changed (0 for a model without DoRA).
    """
    try:
        from peft.tuners.lora.dora import DoraLinearLayer
    except ImportError:  # no peft, no DoRA
        return 0
    count = 0
    for module in model.modules():
        # Exactly DoraLinearLayer: the embedding and convolution variants compute B @ A their own way.
        if type(module) is DoraLinearLayer:
            module.get_lora_weight = _lora_weight
            count += 1
    return count
