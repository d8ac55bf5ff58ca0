"""The mixture-of-experts part of the memory plan: fused expert weights in 4 or 16 bits, and top-k activations.

:func:`hf_fsdp_qlora.load_qlora_model` quantizes the fused 3-D experts to 4 bits (:mod:`hf_fsdp_qlora.experts.quantized`):
per expert and weight, the packed bytes (a frozen parameter ``[experts, packed]`` that FSDP shards like the linear
layers' bytes) and the quantization constants - absmax per 64 weights (uint8 with double quant, else fp32), with
double quant the nested absmax per 256 blocks and an offset, and the code tables - as buffers, whole on every
rank. A stock ``load_in_4bit`` (or ``quantize_experts=False``, or an 8-bit base: bitsandbytes only replaces
``nn.Linear``) keeps them in the model's 16-bit dtype. The router is a plain parameter, kept 16-bit either way.

The forward dequantizes the routed experts of each weight at once for one grouped matmul (the grouped workspace,
``grouped_numel``; the per-expert loop, the fallback, one at a time), and autograd keeps them for the input gradient
until backward: with checkpointing that is one layer's routed experts (during the layer's recompute and backward),
without it every layer's (``saved_numel``). The grouped workspace is part of those, so it adds only what the one
bitsandbytes call reads beside them (``grouped_extra``: the routed experts' absmax in fp32 with double quant, and a
copy of their packed bytes and constants when only some experts are routed). Activations: :mod:`.activations`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model_shapes import ModelShape

__all__ = ["ExpertBytes", "expert_bytes"]

BLOCKSIZE = 64  # QuantizedExperts quantizes like bitsandbytes' linear layers
NESTED_BLOCKSIZE = 256
CODE_BYTES = 16 * 4  # NF4/FP4 code table, fp32
NESTED_CODE_BYTES = 256 * 4  # the 8-bit dynamic code of double quant, fp32


@dataclass
class ExpertBytes:
    """What the experts of a model take, as the run holds them."""

    quantized: bool
    quantized_numel: int  # expert weights held in 4 bits (0 when they stay 16-bit)
    packed: int  # their packed bytes, sharded 1/N like the linear layers' bytes
    quant_state: int  # their constants, whole on every rank
    per_layer_numel: int  # the largest layer's expert weights
    workspace_numel: int  # one expert's largest weight, dequantized for one matmul
    saved_numel: int  # the largest layer's routed experts kept dequantized for backward
    layer_packed: int = 0  # the largest layer's packed bytes (stacked once more while loading)
    grouped_numel: int = 0  # grouped compute: the largest weight of one layer's routed experts, dequantized at once
    grouped_extra: int = 0  # bytes the grouped dequantization reads beside it (fp32 absmax, copies of routed rows)


def _state_bytes(num_experts: int, numel: int, double_quant: bool) -> int:
    blocks = math.ceil(numel / BLOCKSIZE)
    if not double_quant:
        return num_experts * blocks * 4 + CODE_BYTES
    nested = math.ceil(blocks / NESTED_BLOCKSIZE)
    return num_experts * (blocks + nested * 4 + 4) + CODE_BYTES + NESTED_CODE_BYTES


def _grouped_extra(num_experts: int, hit: int, numel: int, double_quant: bool) -> int:
    """What dequantizing `hit` routed experts' weight in one call reads beside its output (experts/grouped.py)."""
    blocks = math.ceil(numel / BLOCKSIZE)
    extra = hit * blocks * 4 if double_quant else 0  # the nested absmax dequantized to fp32
    if hit < num_experts:  # only some experts routed: their rows are copied out of the stored stacks
        extra += hit * (math.ceil(numel / 2) + (blocks if double_quant else blocks * 4))
    return extra


def expert_bytes(shape: ModelShape, quantized: bool, double_quant: bool, tokens: int) -> ExpertBytes:
    """The experts' bytes for `tokens` tokens per forward; `quantized`: held in 4 bits (``quantize_experts``)."""
    packed = state = quantized_numel = 0
    workspace = saved = layer_packed = grouped = extra = 0
    for experts in shape.experts:
        held = quantized and experts.quantizable
        per_expert = sum(experts.expert_numel(n) for n in experts.weights)
        # Tokens routed per forward bound the experts hit (every one of them at any real batch).
        hit = min(experts.num_experts, tokens * max(1, shape.experts_per_token))
        saved = max(saved, hit * per_expert)
        for name in experts.weights:
            numel = experts.expert_numel(name)
            if held:
                quantized_numel += experts.num_experts * numel
                packed += experts.num_experts * math.ceil(numel / 2)
                state += _state_bytes(experts.num_experts, numel, double_quant)
                workspace = max(workspace, numel)
                grouped = max(grouped, hit * numel)
                extra = max(extra, _grouped_extra(experts.num_experts, hit, numel, double_quant))
        if held:
            layer_packed = max(layer_packed, sum(experts.num_experts * math.ceil(experts.expert_numel(n) / 2)
                                                 for n in experts.weights))  # fmt: skip
    return ExpertBytes(
        quantized=quantized,
        quantized_numel=quantized_numel,
        packed=packed,
        quant_state=state,
        per_layer_numel=shape.per_layer("experts"),
        workspace_numel=workspace,
        saved_numel=saved if quantized_numel else 0,
        layer_packed=layer_packed,
        grouped_numel=grouped,
        grouped_extra=extra,
    )
