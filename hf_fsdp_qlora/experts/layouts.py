"""Where each mixture-of-experts family keeps its fused expert weights: what the loader, the merge and the model
shapes all read (below all three, so none imports another to learn it).

transformers 5 declares the layout of most experts classes itself: ``use_experts_implementation(is_concatenated=,
is_transposed=, has_bias=, has_gate=, has_post_expert_norm=)`` decorates the class, and its ``__init__`` records the
flags on every instance (``has_gate``, ``is_transposed``, ...) for the forwards ``ExpertsInterface`` dispatches to.
:func:`expert_layout` reads those flags: any decorated class is known, whatever its name. A class outside that
contract keeps a named entry (:data:`EXPERT_LAYOUTS`); anything else is refused by the loader, by module path.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = [
    "EXPERT_LAYOUTS",
    "EXPERT_REFUSALS",
    "EXPERT_WEIGHT_NAMES",
    "ExpertLayout",
    "declared_layout",
    "expert_layout",
    "experts_tensors",
    "has_fused_experts",
    "is_experts_module",
]


@dataclass(frozen=True)
class ExpertLayout:
    """Where a family's experts module keeps its fused 3-D weights, and how its forward uses them.

    Attributes:
        weights: the 3-D ``[E, out, in]`` (or ``[E, in, out]`` when `transposed`) weight parameters, in call order:
            the first projection (``gate_up_proj``, or ``up_proj`` without a gate), then ``down_proj``.
        biases: ``[E, out]`` bias parameters, one per weight (empty when the family has none).
        transposed: the weights are stored ``[E, in, out]`` and applied as ``x @ W``.
        gated: the first projection's output goes through the family's gate (``_apply_gate``: concatenated or
            interleaved gate/up, the class's own business); without a gate, through its activation ``act_fn``.
        post_norm: the child module applied to each expert's output before the routing weight, or None.
        call: how the family calls the module. ``"routed"``: transformers' experts call ``(hidden, top_k_index,
            top_k_weights)``. ``"dense"``: ``experts(rows)``, ``rows`` ``[E * T, H]``, expert e's input in rows
            ``e*T .. e*T+T-1`` already scaled by its routing score (Llama 4). ``"split"``: ``experts(rows,
            expert_size)``, rows sorted by expert, ``expert_size[e]`` of them for expert e, one projection and no
            activation (JetMoE's ``input_linear`` / ``output_linear``).
        peft_transposed: peft reads the weights as ``[E, in, out]`` (it asks the module's ``is_transposed``; a class
            outside transformers' contract has none, and peft then adds ``B_e @ A_e`` to the stored matrix as is).
        zero_experts: the first weight holds more experts than the last; the router's indices past the last weight's
            experts pick "zero-computation" experts that return their input (LongCat-Flash). Their rows of the
            first weight are stored (and merged, as peft merges them) but no forward reads them.
    """

    weights: tuple[str, ...] = ("gate_up_proj", "down_proj")
    biases: tuple[str, ...] = ()
    transposed: bool = False
    gated: bool = True
    post_norm: str | None = None
    call: str = "routed"
    peft_transposed: bool | None = None  # None: as `transposed` (transformers' declared is_transposed)
    zero_experts: bool = False

    @property
    def dense(self) -> bool:
        return self.call == "dense"

    @property
    def lora_transposed(self) -> bool:
        return self.transposed if self.peft_transposed is None else self.peft_transposed


# Experts classes outside transformers' declared contract that we quantize anyway, by class name. Every class
# transformers decorates is read from its flags instead (declared_layout).
EXPERT_LAYOUTS: dict[str, ExpertLayout] = {
    # Llama 4: gate_up [E, H, 2I] and down [E, I, H] applied as x @ W to every expert's slice of the rows
    # (Llama4TextMoe repeats the tokens once per expert, scaled by the router's score); no is_transposed for peft.
    "Llama4TextExperts": ExpertLayout(transposed=True, call="dense", peft_transposed=False),
    # JetMoE: one [E, out, in] weight per module, two modules per MoE block (and per mixture-of-attention block).
    "JetMoeParallelExperts": ExpertLayout(weights=("weight",), gated=False, call="split"),
    # LongCat-Flash: transformers' layout, but gate_up_proj [routed + zero experts, 2I, H] and down_proj [routed, H, I]:
    # an index past the routed experts is an identity expert (the input times its routing weight).
    "LongcatFlashExperts": ExpertLayout(zero_experts=True),
}
# Experts classes refused with a reason of their own, beyond "no declared layout and no named entry". (DBRX's
# DbrxExperts is not refused: the loader swaps it for a declared class first, hf_fsdp_qlora/experts/dbrx.py.)
EXPERT_REFUSALS: dict[str, str] = {}
# The 16-bit weight names any layout uses (a saved 4-bit experts checkpoint is recognised by them).
EXPERT_WEIGHT_NAMES = frozenset({"gate_up_proj", "up_proj", "down_proj"})
# transformers 5.17 (our floor) sets the first four; has_post_expert_norm came later (absent: no such norm)
_FLAGS = ("has_gate", "is_transposed", "has_bias", "is_concatenated")


def declared_layout(module: nn.Module) -> ExpertLayout | None:
    """The layout `module` declares through ``use_experts_implementation`` (the flags its ``__init__`` set), or None
    for a module that declares none."""
    if not all(hasattr(module, flag) for flag in _FLAGS):
        return None
    weights = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    return ExpertLayout(
        weights=weights,
        biases=tuple(f"{w}_bias" for w in weights) if module.has_bias else (),
        transposed=bool(module.is_transposed),
        gated=bool(module.has_gate),
        post_norm="post_expert_norm" if getattr(module, "has_post_expert_norm", False) else None,
    )


def _fits(module: nn.Module, layout: ExpertLayout) -> bool:
    """`module` holds what `layout` names: 3-D weights and 2-D biases with one row per expert, its gate or
    activation, its post-expert norm."""
    weights = [getattr(module, n, None) for n in layout.weights]
    biases = [getattr(module, n, None) for n in layout.biases]
    if not all(isinstance(p, nn.Parameter) for p in weights + biases):
        return False
    experts = weights[-1].shape[0]  # the routed experts (LongCat-Flash's first weight has its zero experts' rows too)
    extra = layout.zero_experts and weights[0].dim() == 3 and weights[0].shape[0] >= experts
    if any(p.dim() != 3 or (p.shape[0] != experts and not (extra and p is weights[0])) for p in weights):
        return False
    if any(b.dim() != 2 or b.shape[0] != experts for b in biases):
        return False
    if layout.call == "split":  # one projection, the caller activates
        return True
    if not hasattr(module, "act_fn") and not (layout.gated and hasattr(module, "_apply_gate")):
        return False  # a gate of its own, or the activation the default gate (and an ungated expert) applies
    return layout.post_norm is None or isinstance(getattr(module, layout.post_norm, None), nn.Module)


def expert_layout(module: nn.Module) -> ExpertLayout | None:
    """The layout of `module` if it is an experts module we can quantize (declared, or a named entry), else None.
    Our own 4-bit experts copy the declared flags but are never quantized again."""
    if getattr(type(module), "packed_experts", False):
        return None
    layout = declared_layout(module) or EXPERT_LAYOUTS.get(type(module).__name__)
    if layout is None or not _fits(module, layout):
        return None
    return layout


def experts_tensors(module: nn.Module) -> list[str]:
    """``name [shape]`` of every tensor an experts module holds (DBRX's sit one module deeper), for messages."""
    found = [*module.named_parameters(), *module.named_buffers()]
    return [f"{name} {list(tensor.shape)}" for name, tensor in found]


def is_experts_module(module: nn.Module) -> bool:
    """Whether `module` is a mixture-of-experts experts module (known to us or not), by what it is: a class in
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
    """Whether `model` (meta-device skeletons included) has an experts module :func:`quantize_experts` would swap
    (DBRX's ``DbrxExperts`` too: quantize_experts first puts them in a declared class, hf_fsdp_qlora/experts/dbrx.py)."""
    return any(expert_layout(m) is not None or type(m).__name__ == "DbrxExperts" for m in model.modules())
