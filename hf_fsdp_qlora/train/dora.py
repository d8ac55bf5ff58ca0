"""DoRA (``LoraConfig(use_dora=True)``) under FSDP1: size DoRA's identity matrix from the layer, not its shard, and
run that identity pass without autograd so that lora_A / lora_B get their gradients in float32 units.

Under FSDP1, transformers installs peft's ``fsdp_auto_wrap_policy``, which makes every leaf module with a trainable
weight its own unit: each ``lora_A`` / ``lora_B`` Linear and each DoRA magnitude (``DoraLinearLayer``). DoRA's
forward computes ``B @ A`` by running ``lora_B(lora_A(eye))`` - through the modules' forwards precisely so FSDP
gathers them - but sizes ``eye`` from ``lora_A.weight.shape[1]``, read before ``lora_A`` runs. Outside its own
unit's forward, ``lora_A.weight`` is that rank's 1-D flat shard, so every rank fails in the first forward with
``IndexError: tuple index out of range`` (peft/tuners/lora/dora.py, ``get_lora_weight``). We read the width from
``lora_A.in_features`` (a plain attribute, whole on every rank) and keep peft's units.

That identity pass is the first of two forwards of each lora_A / lora_B unit per step (the second runs on the
input). FSDP1 hooks a unit's gradient reduce-scatter on the ``AccumulateGrad`` node of the unit's *first* forward
(torch/distributed/fsdp/_runtime_utils.py, ``_register_post_backward_hook``). With float32 adapters gathered as
bf16 (mixed precision ``param_dtype``), each gather and free swaps the FlatParameter's ``.data`` between dtypes, and
autograd then drops the parameter's ``AccumulateGrad`` (measured: a dtype change through ``.data`` gives a new node,
a same-dtype change does not), so every forward gets a node of its own. peft uses the identity pass's result only
detached (the weight norm is a constant, section 4.3 of the DoRA paper): the hooked node never ran, and lora_A /
lora_B got no gradient at all (``grad`` None; the magnitudes, one forward each, trained). Run without autograd, the
identity pass computes the same values and registers no hook, so FSDP1 hooks the input pass's node. 16-bit units
(no dtype change) kept one node for both forwards, which is why bf16 adapters trained.

The alternative - one unit for the whole LoRA-wrapped Linear, or no separate LoRA units inside the decoder layer -
puts frozen 4-bit weights and trainable adapters in one FlatParameter (a per-rank gradient the size of the sharded
base model under ``use_orig_params=True``), and DoRA reads the base weight outside the base layer's forward, so the
base cannot be a nested unit either. Reading the weights inside ``summon_full_params`` is no option: FSDP1 refuses it
during forward and backward. Activation checkpointing recomputes the same forward, so it needs nothing more.
"""

from __future__ import annotations

import torch

__all__ = ["size_dora_identity_from_layer"]


def _lora_weight(lora_A, lora_B, adapter_name=None):
    """peft's ``DoraLinearLayer.get_lora_weight`` with the identity sized by ``lora_A.in_features``, without autograd
    (peft detaches the result: only the input pass may register FSDP1's post-backward hook)."""
    shard = lora_A.weight  # device and dtype only: a flat shard has the whole weight's
    eye = torch.eye(lora_A.in_features, device=shard.device, dtype=shard.dtype)
    with torch.no_grad():
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
