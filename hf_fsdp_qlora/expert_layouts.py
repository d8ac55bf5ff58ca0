"""Where each mixture-of-experts family keeps its fused expert weights: the table the loader, the merge and the
model shapes all read (below all three, so none imports another to learn it)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["EXPERT_LAYOUTS", "ExpertLayout", "expert_layout", "has_fused_experts", "is_experts_module"]


@dataclass(frozen=True)
class ExpertLayout:
    """Where a family's experts module keeps its fused 3-D weights.

    Attributes:
        weights: the 3-D ``[E, out, in]`` (or ``[E, in, out]`` when `transposed`) weight parameters, in call order.
        biases: ``[E, out]`` bias parameters, one per weight (empty when the family has none).
        transposed: the weights are stored ``[E, in, out]`` and applied as ``x @ W``.
    """

    weights: tuple[str, ...] = ("gate_up_proj", "down_proj")
    biases: tuple[str, ...] = ()
    transposed: bool = False


# Families whose experts we quantize, by experts class (transformers 5.23). All of them gate with `_apply_gate`
# (installed by transformers' `use_experts_implementation`) and take (hidden_states, top_k_index, top_k_weights).
_GATED = ExpertLayout()
EXPERT_LAYOUTS = {
    "Qwen3MoeExperts": _GATED,
    "Qwen2MoeExperts": _GATED,
    "Qwen3_5MoeExperts": _GATED,
    "Qwen3NextExperts": _GATED,
    "Qwen3VLMoeTextExperts": _GATED,
    "MixtralExperts": _GATED,
    "DeepseekV2Experts": _GATED,
    "DeepseekV3Experts": _GATED,
    "Glm4MoeExperts": _GATED,
    "OlmoeExperts": _GATED,
    "GptOssExperts": ExpertLayout(biases=("gate_up_proj_bias", "down_proj_bias"), transposed=True),
}


def expert_layout(module: nn.Module) -> ExpertLayout | None:
    """The layout of `module` if it is an experts module we can quantize, else None."""
    layout = EXPERT_LAYOUTS.get(type(module).__name__)
    if layout is None or not hasattr(module, "_apply_gate"):
        return None
    names = layout.weights + layout.biases
    if not all(isinstance(getattr(module, n, None), nn.Parameter) for n in names):
        return None
    return layout


def is_experts_module(module: nn.Module) -> bool:
    """Whether `module` is a mixture-of-experts experts module (known to the table or not), by what it is: a class in
    :data:`EXPERT_LAYOUTS`, a class transformers' ``use_experts_implementation`` decorated (it sets ``has_gate`` and
    ``is_concatenated`` on each instance), or a class named ``...Experts`` with no linear layer in it (routed experts
    kept as their own tensors). Never by a tensor's number of dimensions: a Conv1d (LFM2, Falcon-H1, Mamba mixers)
    holds a 3-D weight too. Our own 4-bit experts (``packed_experts`` class marker) are not counted again."""
    cls = type(module)
    if getattr(cls, "packed_experts", False):
        return False
    if cls.__name__ in EXPERT_LAYOUTS:
        return True
    if hasattr(module, "has_gate") and hasattr(module, "is_concatenated"):
        return True
    name = cls.__name__
    if not name.endswith("Experts") or name.endswith("SharedExperts"):
        return False  # shared experts are dense MLPs of linear layers, which bitsandbytes quantizes itself
    has_params = any(True for _ in module.parameters())
    return has_params and not any(isinstance(m, nn.Linear) for m in module.modules())


def has_fused_experts(model: nn.Module) -> bool:
    """Whether `model` (meta-device skeletons included) has an experts module :func:`quantize_experts` would swap."""
    return any(expert_layout(m) is not None for m in model.modules())
