"""The routers of mixture-of-experts blocks: linear layers that score the experts, never LoRA targets of "all-linear"
(``load_qlora_model``, the doctor).

A router's output picks the experts; LoRA on it changes the routing, not a layer's output, and several families'
routers are ``nn.Linear`` subclasses whose forward returns a tuple (Phi-MoE's ``PhimoeTopKRouter``, Llama 4's
``Llama4Router``), which peft's LoRA layer cannot wrap: ``AttributeError: 'tuple' object has no attribute 'dtype'``
at the first forward. peft's own ``"all-linear"`` takes every ``nn.Linear``, routers included.
"""

from __future__ import annotations

from torch import nn

from .layouts import is_experts_module

__all__ = ["router_layers"]


def _experts_count(module: nn.Module) -> int | None:
    if getattr(type(module), "packed_experts", False):  # our 4-bit experts
        return module.num_experts
    if not is_experts_module(module):
        return None
    count = getattr(module, "num_experts", None)
    if count is None:
        weights = [p for p in module.parameters() if p.dim() == 3]
        count = weights[0].shape[0] if weights else None
    return count


def router_layers(model: nn.Module) -> set[str]:
    """The full names of the routers in `model`: in a block holding an experts module, a linear layer (the block's
    child, or the one linear layer of a gating child such as Granite-MoE's ``router.layer``) with one output per
    expert. Shared experts (children with several linear layers) and a shared expert's scalar gate are not routers."""
    routers = set()
    for block_name, block in model.named_modules():
        counts = [c for c in (_experts_count(child) for child in block.children()) if c]
        if not counts:
            continue
        for child_name, child in block.named_children():
            linear = [(n, m) for n, m in child.named_modules() if isinstance(m, nn.Linear)]
            if len(linear) != 1:  # none, or an MLP (shared experts)
                continue
            name, layer = linear[0]
            if layer.out_features in counts:
                parts = [block_name, child_name, name]
                routers.add(".".join(p for p in parts if p))
    return routers
