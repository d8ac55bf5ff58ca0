"""4-bit mixture-of-experts weights: the expert layouts we know, the quantized experts module, and the swap.

transformers 5 stores the experts of most MoE families as fused 3-D parameters (``gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``; gpt-oss transposed, with biases), and bitsandbytes' 4-bit loading only replaces
``nn.Linear``: after ``load_in_4bit`` the experts - most of an MoE model's weights - are still 16-bit.
:func:`quantize_experts` replaces each experts module by :class:`QuantizedExperts`, which holds every expert's
weights as NF4 (or FP4) bytes and dequantizes the routed experts in its forward: all of a weight's at once for
one grouped matmul (:mod:`.grouped`), or one at a time in the per-expert loop kept as reference and fallback.

The packed bytes are a frozen ``nn.Parameter`` of shape ``[E, n]`` in the one storage dtype (the bytes viewed as
that dtype, never converted), so FSDP1 flattens it with the rest of its unit and FSDP2 shards it on the expert
dimension. The quantization constants (absmax, and with double quant the nested absmax and offset) are small
buffers: FSDP leaves buffers whole on every rank and casts nothing, so they survive wrapping untouched.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from ..dtypes import PACKED_EXPERTS_ATTR
from ..errors import UnsupportedSetupError
from .layouts import (
    EXPERT_LAYOUTS,
    EXPERT_REFUSALS,
    ExpertLayout,
    expert_layout,
    experts_tensors,
    has_fused_experts,
    is_experts_module,
)
from .lora_rows import (
    _lora_A_rows,
    _lora_A_rows_stored,
    _lora_B_rows,
    _lora_B_rows_stored,
    run_with_weight,
)

__all__ = [
    "EXPERT_LAYOUTS",
    "ExpertLayout",
    "QuantizedExperts",
    "expert_layout",
    "has_fused_experts",
    "packed_expert_bytes",
    "quantize_experts",
    "run_with_weight",
]

logger = logging.getLogger(__name__)

# Run on each QuantizedExperts built: expert_lora (a layer above; loading/__init__.py imports it first) adds peft's hook.
ON_BUILD: list = []


class QuantizedExperts(nn.Module):
    """A family's experts module with every expert's weights in 4 bits, dequantized for the experts routed.

    Built from the 16-bit experts module by :func:`quantize_experts`. The forward honours transformers' experts
    call, ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, and runs the family's
    own gate (``_apply_gate``). Only the experts that tokens were routed to are dequantized: grouped (``compute``,
    :mod:`.grouped`), a weight's routed experts at once for one grouped matmul - the 16-bit stack autograd keeps
    for the backward anyway; in the per-expert loop (reference and fallback) one at a time.

    LoRA on the experts (peft's ``target_parameters``, :mod:`hf_fsdp_qlora.experts.lora`): peft's
    ``ParamWrapper`` modules hold the adapters in peft's own layout and format; while they run this module
    (:meth:`lora_active`) each routed expert's output gets ``scale * (x A_e^T) B_e^T``, with ``A_e``/``B_e`` that
    expert's slices of ``lora_A``/``lora_B`` - the update peft would add to that expert's weight, never formed.
    """

    packed_experts = True  # expert_layouts.is_experts_module: already ours, never swapped or counted again
    # "auto": grouped (experts/grouped.py) where grouped_mm runs this dtype and device, else the per-expert loop;
    # "loop": always the loop (the reference); "grouped": grouped or a clear error. Set per instance to compare.
    compute = "auto"

    def __init__(
        self, experts: nn.Module, layout: ExpertLayout, *, quant_type: str, double_quant: bool, dtype, device=None
    ):
        """`device`: where the packed experts live (default: where the 16-bit ones are). Each expert's 16-bit weight
        moves there alone and is quantized there, so a GPU never holds more than one 16-bit expert weight."""
        super().__init__()
        from bitsandbytes.functional import quantize_4bit

        self.family = type(experts).__name__
        self.layout = layout
        self.quant_type = quant_type
        self.dtype = dtype
        # The family's own settings (num_experts, alpha/limit for gpt-oss, config, act_fn module ...).
        for key, value in vars(experts).items():
            if not key.startswith("_") and key not in ("training", "family", "layout", "quant_type", "dtype"):
                setattr(self, key, value)
        for key, child in experts.named_children():
            self.add_module(key, child)
        # The family's gate (concatenated or interleaved gate/up, its own activation), or without one its act_fn.
        self._family_gate = getattr(type(experts), "_apply_gate", None) if layout.gated else None
        # The routed experts: the last weight's (LongCat-Flash's first weight also holds its zero experts' rows).
        self.num_experts = getattr(experts, "num_experts", getattr(experts, layout.weights[-1]).shape[0])
        self._meta = {}
        self._rows = {name: getattr(experts, name).shape[0] for name in layout.weights}  # experts stored per weight
        self._lora = {}  # weight name -> [(lora_A, lora_B, scaling)], set by peft's wrappers while they run
        device = torch.device(device) if device is not None else getattr(experts, layout.weights[0]).device
        for name in layout.weights:
            weight = getattr(experts, name).detach()
            packed, absmax, nested = [], [], []
            for e in range(weight.shape[0]):
                data, state = quantize_4bit(
                    weight[e].to(device=device, dtype=dtype).contiguous(),
                    compress_statistics=double_quant,
                    quant_type=quant_type,
                    quant_storage=dtype,
                )
                packed.append(data.reshape(-1))
                absmax.append(state.absmax)
                if state.nested:
                    nested.append((state.state2.absmax, state.offset))
            param = nn.Parameter(torch.stack(packed), requires_grad=False)
            setattr(param, PACKED_EXPERTS_ATTR, True)  # harmonize_dtypes never casts it
            self.register_parameter(f"{name}_4bit", param)
            self.register_buffer(f"{name}_absmax", torch.stack(absmax), persistent=False)
            self.register_buffer(f"{name}_code", state.code, persistent=False)
            if nested:
                self.register_buffer(f"{name}_absmax2", torch.stack([a for a, _ in nested]), persistent=False)
                self.register_buffer(f"{name}_offset", torch.stack([o for _, o in nested]), persistent=False)
                self.register_buffer(f"{name}_code2", state.state2.code, persistent=False)
            self._meta[name] = (tuple(weight.shape[1:]), state.blocksize, state.state2.blocksize if nested else None)
        for name in layout.biases:
            self.register_parameter(
                name, nn.Parameter(getattr(experts, name).detach().to(device, dtype), requires_grad=False)
            )
        # Whole, as quantized: under FSDP each rank's parameters hold a part (engagement log, packed_expert_bytes).
        self.packed_bytes = sum(getattr(self, f"{n}_4bit").nbytes for n in layout.weights)
        for hook in ON_BUILD:  # peft's own loaders (PeftModel.from_pretrained, load_adapter) must see these weights
            hook()

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={[self.num_experts, *self._meta[n][0]]}" for n in self.layout.weights)
        return f"family={self.family}, {self.quant_type}, {shapes}"

    def __getattr__(self, name: str):
        # peft's ParamWrapper reads the weight it adapts (``getattr(base, "gate_up_proj")``) for its shape, dtype
        # and device only (its own forward, which would write into it, is replaced: expert_lora.py).
        try:
            return super().__getattr__(name)
        except AttributeError:
            meta = self.__dict__.get("_meta")
            if meta is None or name not in meta:
                raise
            return self.logical_weight(name)

    def logical_weight(self, name: str) -> torch.Tensor:
        """A stand-in for the 16-bit weight `name`: its shape, dtype and device, zero bytes (every element one 0)."""
        packed = self._parameters[f"{name}_4bit"]
        zero = torch.zeros((), dtype=self.dtype, device=packed.device)
        return zero.expand(self._rows[name], *self._meta[name][0])

    @contextmanager
    def lora_active(self, name: str, factors: list):
        """Within: the weight `name` gets the LoRA updates `factors` (``(lora_A, lora_B, scaling)`` per adapter)."""
        if factors:
            self._lora[name] = factors
        try:
            yield
        finally:
            self._lora.pop(name, None)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self.layout.gated:  # has_gate=False (Nemotron-H): the up projection's activation only
            return self.act_fn(gate_up)
        if self._family_gate is None:  # a named class without one (Llama 4): transformers' default gate
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up
        return self._family_gate(self, gate_up)

    def post_expert(self, out: torch.Tensor) -> torch.Tensor:
        """Each expert's output after its down projection, before the routing weight (``has_post_expert_norm``)."""
        return out if self.layout.post_norm is None else getattr(self, self.layout.post_norm)(out)

    apply_gate = _apply_gate  # the family's gate, for the grouped path

    def expert_rows(self, name: str) -> int:
        """How many experts the weight `name` stores (peft's LoRA on it has that many rank blocks)."""
        return self._rows[name]

    def quant_meta(self, name: str) -> tuple:
        """(stored shape of one expert's weight `name`, blocksize, nested blocksize or None)."""
        return self._meta[name]

    def lora_factors(self, name: str) -> list:
        """The ``(lora_A, lora_B, scaling)`` of the adapters running on the weight `name` now (empty: none)."""
        return self._lora.get(name, [])

    def dequantize_expert(self, name: str, expert: int) -> torch.Tensor:
        """Expert `expert`'s weight `name` (e.g. ``"gate_up_proj"``) in the compute dtype, in its stored layout."""
        from bitsandbytes.functional import QuantState, dequantize_4bit

        shape, blocksize, blocksize2 = self._meta[name]
        state2, offset = None, None
        if blocksize2 is not None:
            state2 = QuantState(
                absmax=getattr(self, f"{name}_absmax2")[expert],
                code=getattr(self, f"{name}_code2"),
                blocksize=blocksize2,
                dtype=torch.float32,
            )
            offset = getattr(self, f"{name}_offset")[expert]
        state = QuantState(
            absmax=getattr(self, f"{name}_absmax")[expert],
            shape=torch.Size(shape),
            code=getattr(self, f"{name}_code"),
            blocksize=blocksize,
            quant_type=self.quant_type,
            dtype=self.dtype,
            offset=offset,
            state2=state2,
        )
        return dequantize_4bit(getattr(self, f"{name}_4bit")[expert].reshape(-1, 1), state)

    def _project(self, x: torch.Tensor, index: int, expert: int) -> torch.Tensor:
        weight = self.dequantize_expert(self.layout.weights[index], expert)
        out = x @ weight if self.layout.transposed else nn.functional.linear(x, weight)
        if self.layout.biases:
            out = out + getattr(self, self.layout.biases[index])[expert]
        return out

    def _project_routed(self, x: torch.Tensor, index: int, experts: list[int], counts: list[int]) -> torch.Tensor:
        """Rows of `x` grouped by expert (`counts` rows for each of `experts`) through weight `index`, with LoRA."""
        out = torch.cat([self._project(c, index, e) for c, e in zip(x.split(counts), experts)])
        rows = self._rows[self.layout.weights[index]]
        for lora_A, lora_B, scaling in self._lora.get(self.layout.weights[index], ()):
            # Through the adapters' own forwards: under FSDP1 each is its own unit and its weight is whole only there.
            if self.layout.transposed and not self.layout.lora_transposed:
                # peft added B_e @ A_e to the stored [in, out] matrix as is (Llama 4): x @ B_e @ A_e
                low = run_with_weight(lora_B, _lora_B_rows_stored, x, experts, counts, rows)
                delta = run_with_weight(lora_A, _lora_A_rows_stored, low, experts, counts, rows)
            else:
                low = run_with_weight(lora_A, _lora_A_rows, x, experts, counts, rows)
                delta = run_with_weight(lora_B, _lora_B_rows, low, experts, counts, rows)
            out = out + scaling * delta.to(out.dtype)
        return out

    def forward(self, hidden_states: torch.Tensor, top_k_index=None, top_k_weights=None):
        # As bitsandbytes' Linear4bit: compute in the dtype the experts were quantized for, return the input's dtype
        # (a bf16 model with float32 compute, or a float32 model with bf16 compute, mixes the two otherwise).
        # The routing weights stay as the router made them: the family's own experts multiply by them uncast.
        input_dtype = hidden_states.dtype
        if self.layout.dense:
            return self._dense_forward(hidden_states.to(self.dtype)).to(input_dtype)
        if self.layout.call == "split":  # JetMoE: (rows sorted by expert, rows per expert)
            counts = [int(c) for c in top_k_index]
            rows = hidden_states.to(self.dtype)
            return self._project_routed(rows, 0, list(range(self.num_experts)), counts).to(input_dtype)
        if self.layout.zero_experts:
            return self._forward_with_zero_experts(hidden_states, top_k_index, top_k_weights).to(input_dtype)
        return self._forward(hidden_states.to(self.dtype), top_k_index, top_k_weights).to(input_dtype)

    def _forward_with_zero_experts(self, hidden_states, top_k_index, top_k_weights):
        """LongCat-Flash: an index past the routed experts is an identity expert (its input times its routing weight);
        those slots are marked dropped (index num_experts, which both paths skip) for the routed experts."""
        zero = top_k_index >= self.num_experts
        identity = hidden_states * (top_k_weights * zero).sum(-1, keepdim=True).to(hidden_states.dtype)
        routed = top_k_index.masked_fill(zero, self.num_experts)
        return self._forward(hidden_states.to(self.dtype), routed, top_k_weights) + identity.to(self.dtype)

    def _dense_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Every expert on its own slice of `rows` (``[E * T, H]``, Llama 4's call), expert by expert."""
        experts, counts = list(range(self.num_experts)), [rows.shape[0] // self.num_experts] * self.num_experts
        return self._project_routed(
            self._apply_gate(self._project_routed(rows, 0, experts, counts)), 1, experts, counts
        )

    def _forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        from . import grouped as _grouped

        reason = "compute='loop' was asked" if self.compute == "loop" else None
        reason = reason or _grouped.unavailable_reason(self, hidden_states.device)
        if reason is not None and self.compute == "grouped":
            raise UnsupportedSetupError(f"{self.family} experts cannot compute grouped: {reason}. Set compute='auto'.")
        _grouped.log_path_once(self, reason)
        if reason is None:
            return _grouped.grouped_forward(self, hidden_states, top_k_index, top_k_weights)
        return self._loop_forward(hidden_states, top_k_index, top_k_weights)

    def _loop_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The reference: each routed expert dequantized and multiplied on its own."""
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            # num_experts + 1 classes: some routers mark dropped slots with index num_experts.
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        hit = [e for e in hit if e != self.num_experts]
        if self._lora and hit:
            # LoRA: every routed row at once, so each adapter runs once per layer (one FSDP1 gather, not one per expert).
            where = [torch.where(mask[e]) for e in hit]
            slots, tokens = torch.cat([w[0] for w in where]), torch.cat([w[1] for w in where])
            counts = [len(w[1]) for w in where]
            out = self._apply_gate(self._project_routed(hidden_states[tokens], 0, hit, counts))
            out = self.post_expert(self._project_routed(out, 1, hit, counts)) * top_k_weights[tokens, slots, None]
            return final.index_add_(0, tokens, out.to(final.dtype))
        for expert in hit:
            top_k_pos, token_idx = torch.where(mask[expert])
            out = self._apply_gate(self._project(hidden_states[token_idx], 0, expert))
            out = self.post_expert(self._project(out, 1, expert)) * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


def packed_expert_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of packed 4-bit expert weights this rank holds, bytes of all of them); (0, 0) without 4-bit experts.

    Under FSDP2 a rank holds its DTensor shards, under FSDP1 (``use_orig_params``) its views into the flat shard.
    """
    local = full = 0
    for module in model.modules():
        if isinstance(module, QuantizedExperts):
            full += module.packed_bytes
            for name in module.layout.weights:
                param = getattr(module, f"{name}_4bit")
                param = param.to_local() if hasattr(param, "to_local") else param
                local += param.numel() * param.element_size()
    return local, full


def quantize_experts(
    model: nn.Module, *, quant_type: str = "nf4", double_quant: bool = True, dtype=None, device=None
) -> list[str]:
    """Replace every fused experts module of `model` by a :class:`QuantizedExperts` (4-bit), in place.

    Args:
        model: a transformers model, typically just loaded with ``load_in_4bit`` (its experts still 16-bit).
        quant_type: ``"nf4"`` or ``"fp4"``, as for the linear layers.
        double_quant: quantize the per-block absmax too, as ``bnb_4bit_use_double_quant`` does for linear layers.
        dtype: storage and compute dtype (default: the experts' own dtype).
        device: where the packed experts go, one expert quantized there at a time (default: where each experts
            module's 16-bit weights are). ``load_qlora_model`` loads the 16-bit experts on the CPU and packs them
            onto the GPU this way.

    Returns:
        The names of the replaced modules (empty for a dense model).

    Raises:
        UnsupportedSetupError: an experts module (by class: :func:`~hf_fsdp_qlora.experts.layouts.is_experts_module`)
            that declares no layout (transformers' ``use_experts_implementation``) and has no named entry; it names
            the module path, the tensors found and the way to load it knowingly in 16 bits, instead of leaving the
            experts unquantized silently.
    """
    from .dbrx import fuse_dbrx_experts

    fuse_dbrx_experts(model)  # DBRX's 2-D expert stacks into transformers' layout first (a declared class)
    found = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedExperts):
            continue
        layout = expert_layout(module)
        if layout is not None:
            found.append((name, module, layout))
        elif is_experts_module(module):
            raise UnsupportedSetupError(_refusal(name, module))
    for name, module, layout in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        weight_dtype = getattr(module, layout.weights[0]).dtype
        quantized = QuantizedExperts(
            module,
            layout,
            quant_type=quant_type,
            double_quant=double_quant,
            dtype=dtype or weight_dtype,
            device=device,
        )
        setattr(parent, child, quantized)
    if found:
        logger.info("hf_fsdp_qlora: quantized the experts of %d MoE layers to 4 bits (%s)", len(found), quant_type)
    return [name for name, _, _ in found]


def _refusal(name: str, module: nn.Module) -> str:
    """Why the experts module `module` at `name` cannot be quantized: where it is, what it holds, what to do."""
    why = EXPERT_REFUSALS.get(type(module).__name__)  # what in this class's layout stands in the way
    return (
        f"{type(module).__name__} at {name!r} holds the experts of a mixture-of-experts layer "
        f"({', '.join(experts_tensors(module)) or 'no tensors'}) in a layout hf_fsdp_qlora cannot quantize "
        "to 4 bits: the class neither declares its layout through transformers' use_experts_implementation nor has "
        "a named entry in hf_fsdp_qlora.experts.layouts.EXPERT_LAYOUTS. Pass quantize_experts=False to "
        "load_qlora_model to keep these experts in 16 bits knowingly (they then take about 4x the memory of 4-bit "
        f"experts).{f' {why}.' if why else ''}"
    )
