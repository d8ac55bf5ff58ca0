"""Activations a decoder layer saves for backward, per token: a Llama-style layer, and MoE blocks with top-k routing.

See :mod:`hf_fsdp_qlora.doctor.memory` for how the plan uses them (with and without checkpointing, offloading).
"""

from __future__ import annotations

from ..model_shapes import ModelShape
from .setup import RunSetup

__all__ = ["layer_activation_bytes", "layer_activations", "mlp_width", "moe_mlp_activation"]


def layer_activation_bytes(shape: ModelShape, setup: RunSetup, act: int, lora: bool) -> float:
    """Bytes saved for backward per token in one Llama-style decoder layer: RMSNorm, attention, gated MLP, LoRA
    inputs and dropout masks."""
    h, inter = shape.hidden_size, shape.intermediate_size
    q = shape.num_heads * shape.head_dim
    kv = shape.num_kv_heads * shape.head_dim
    # transformers repeats K/V to all heads before sdpa/eager attention; flash attention takes GQA as is.
    kv_saved = kv if setup.attn_implementation.startswith("flash") else q
    norms = 2 * (4 * h + act * h)  # fp32 input copy + normalised value, twice per layer
    attention = act * h + act * (q + 2 * kv_saved) + act * q + 4 * shape.num_heads + act * q
    if setup.attn_implementation == "eager":  # attention probabilities, fp32 softmax and its cast
        attention += shape.num_heads * setup.seq_len * (4 + act)
    mlp = act * h + 4 * act * inter
    extra = 0.0
    if lora and shape.num_layers:
        ins = shape.lora_in_features()
        dropout = (act + 1) * sum(ins) if setup.lora_dropout > 0 else 0  # dropout output + mask per adapter
        extra = (dropout + act * setup.lora_r * len(ins)) / shape.num_layers
        if setup.use_dora:  # DoRA saves the base output and the LoRA output of each adapted Linear for backward
            extra += (
                2
                * act
                * sum(lin.out_features for lin in shape.linears if lin.lora and lin.layer is not None)
                / shape.num_layers
            )
    return norms + attention + mlp + extra


def moe_mlp_activation(shape: ModelShape, act: int) -> float:
    """Bytes saved for backward per token by one MoE block: router, the top-k experts' inputs and gated MLPs, and
    the shared experts."""
    h, k, width, experts = shape.hidden_size, shape.experts_per_token, shape.expert_width, shape.experts[0]
    router = experts.num_experts * (act + 4) + k * (4 + 8)  # logits, fp32 softmax, top-k weights and indices
    routed = k * (2 * act * h + 4 * act * width)  # gathered input, gate/up, activation, product; weighted output
    shared = 4 * act * shape.shared_expert_width + (act * h if shape.shared_expert_width else 0)
    return act * h + router + routed + shared


def mlp_width(shape: ModelShape) -> int:
    """The widest MLP a token runs through in one layer (the backward's transient buffers scale with it)."""
    moe = shape.experts_per_token * shape.expert_width + shape.shared_expert_width
    dense = shape.intermediate_size if len(shape.moe_layers) < shape.num_layers else 0
    return max(moe, dense)


def layer_activations(shape: ModelShape, act: int, dense_layer: float) -> tuple[float, float]:
    """Per-token bytes saved by the largest decoder layer and by all of them, with MoE blocks in place of the dense
    MLP counted in `dense_layer` (DeepSeek's first layers stay dense)."""
    if not shape.experts:
        return dense_layer, shape.num_layers * dense_layer
    dense_mlp = act * shape.hidden_size + 4 * act * shape.intermediate_size
    moe_mlp = moe_mlp_activation(shape, act)
    moe_layers = len(shape.moe_layers)
    largest = dense_layer - dense_mlp + max(moe_mlp, dense_mlp if moe_layers < shape.num_layers else 0)
    return largest, shape.num_layers * dense_layer + moe_layers * (moe_mlp - dense_mlp)
