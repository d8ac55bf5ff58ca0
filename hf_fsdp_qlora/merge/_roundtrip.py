"""The quantization round trip training saw of a base weight (merge ``--dequantize``, vLLM's base sync)."""

from __future__ import annotations

import torch

__all__ = ["quantize_roundtrip"]


def quantize_roundtrip(weight: torch.Tensor, quant_type: str, blocksize: int, double_quant: bool) -> torch.Tensor:
    """Quantize to 4 bit (nf4 / fp4) or 8 bit (int8) and back with bitsandbytes, as training saw the weight.

    Computed from the 16-bit base tensor: never from a weight bitsandbytes already packed (on CPUs with
    avx512_bf16 an eval-mode forward repacks 4-bit weights in place and dequantizing those is wrong).
    """
    import bitsandbytes.functional as bnb_f

    if quant_type == "int8":
        # Int8Params quantizes the float16 copy of the loaded weight, one absmax scale per row (LLM.int8); its
        # outlier handling splits activations, never the stored weight, so this is the weight training used.
        codes, row_scales, _ = bnb_f.int8_vectorwise_quant(weight.to(torch.float16).contiguous())
        return bnb_f.int8_vectorwise_dequant(codes, row_scales)

    packed, state = bnb_f.quantize_4bit(
        weight.contiguous(), blocksize=blocksize, compress_statistics=double_quant, quant_type=quant_type
    )
    return bnb_f.dequantize_4bit(packed, state)
