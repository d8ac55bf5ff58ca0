"""Where each mixture-of-experts family keeps its fused expert weights: the table the loader, the merge and the
model shapes all read (below all three, so none imports another to learn it)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["EXPERT_LAYOUTS", "ExpertLayout", "expert_layout", "has_fused_experts"]


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


def has_fused_experts(model: nn.Module) -> bool:
    """Whether `model` (meta-device skeletons included) has an experts module :func:`quantize_experts` would swap."""
    return any(expert_layout(m) is not None for m in model.modules())
