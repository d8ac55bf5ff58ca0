"""Grouped compute for 4-bit experts: one dequantization and one grouped matmul per projection.

The per-expert loop of :class:`~hf_fsdp_qlora.experts.quantized.QuantizedExperts` dequantizes and multiplies one
routed expert at a time: the operator calls of a layer grow with the experts hit (at Qwen3-30B-A3B's shape about
30 per routed expert, forward and backward). Here the routed rows are sorted by expert once, the routed experts of
each weight are dequantized in one bitsandbytes call into one ``[k, out, in]`` buffer, and each projection is one
``grouped_mm`` (expert LoRA too: two more, over peft's own ``lora_A`` / ``lora_B`` viewed per expert). Same
routing, same per-row math, same accumulation order into the output as the loop, which stays the reference and
the fallback (:func:`unavailable_reason`).

``grouped_mm`` on CPU (torch 2.13) wants every row stride a multiple of 16 bytes (LoRA ranks are padded with zero
rows to get it) and a contiguous incoming gradient (``.sum()`` hands it an expanded one: "Invalid strides/sizes").
"""

from __future__ import annotations

import logging
import math

import torch

from .lora_rows import run_with_weight

__all__ = ["dequantize_routed", "grouped_forward", "grouped_mm_function", "log_path_once", "unavailable_reason"]

logger = logging.getLogger(__name__)

_CPU_DTYPES = (torch.bfloat16, torch.float32, torch.float16)
_logged: set[str] = set()


def grouped_mm_function():
    """torch's grouped matmul: public ``torch.nn.functional.grouped_mm`` where it exists, else ``torch._grouped_mm``
    (hf_fsdp_qlora/_compat/torch.py `torch_grouped_mm`), else None."""
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def unavailable_reason(module, device: torch.device) -> str | None:
    """Why `module`'s experts cannot compute grouped on `device` (None: they can). The loop runs instead."""
    if grouped_mm_function() is None:
        return f"torch {torch.__version__} has no grouped_mm"
    dtype = module.dtype
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0):
            return f"grouped_mm on CUDA needs bfloat16 on compute capability 8.0+ (here {dtype})"
    elif device.type != "cpu" or dtype not in _CPU_DTYPES:
        return f"grouped_mm is not known to run {dtype} on {device.type}"
    size = torch.empty((), dtype=dtype).element_size()
    dims = {d for name in module.layout.weights for d in module.quant_meta(name)[0]}
    odd = sorted(d for d in dims if d * size % 16)
    if odd:
        return f"grouped_mm needs rows of a multiple of 16 bytes; the experts' dims {odd} in {dtype} are not"
    return None


def log_path_once(module, reason: str | None) -> None:
    """Say once per process which path the 4-bit experts compute with, and why the loop where it runs."""
    message = (
        f"hf_fsdp_qlora: 4-bit experts ({module.family}) compute grouped: one batched dequantization and one "
        "grouped_mm per projection (expert LoRA included)"
        if reason is None
        else f"hf_fsdp_qlora: 4-bit experts ({module.family}) compute one routed expert at a time: {reason}"
    )
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def dequantize_routed(module, name: str, experts: torch.Tensor) -> torch.Tensor:
    """The weight `name` of `experts` (1-D, ascending) in the compute dtype, ``[k, *stored shape]``, in one step.

    The experts' packed bytes and absmax are contiguous per expert, so the selected experts' rows read as one
    quantized tensor when every expert's weight fills whole blocks (and, with double quant, whole nested blocks);
    otherwise each expert is dequantized into its slice of the same buffer. Element for element the loop's values.
    """
    from bitsandbytes.functional import QuantState, dequantize_4bit, dequantize_blockwise

    shape, blocksize, blocksize2 = module.quant_meta(name)
    count, numel = experts.numel(), math.prod(shape)
    blocks = numel // blocksize
    if numel % blocksize or (blocksize2 is not None and blocks % blocksize2):
        out = torch.empty((count, *shape), dtype=module.dtype, device=experts.device)
        for slot, expert in enumerate(experts.tolist()):
            out[slot] = module.dequantize_expert(name, expert)
        return out

    def rows(tensor):  # every expert routed (any real batch): the stored rows as they are, no copy
        return tensor if count == tensor.shape[0] else tensor.index_select(0, experts)

    absmax = rows(getattr(module, f"{name}_absmax"))
    if blocksize2 is not None:
        nested = QuantState(
            absmax=rows(getattr(module, f"{name}_absmax2")).reshape(-1),
            code=getattr(module, f"{name}_code2"),
            blocksize=blocksize2,
            dtype=torch.float32,
        )
        absmax = dequantize_blockwise(absmax.reshape(-1), nested).view(count, blocks)
        absmax += rows(getattr(module, f"{name}_offset")).view(count, 1)
    packed = rows(getattr(module, f"{name}_4bit")).reshape(-1, 1)
    state = QuantState(absmax=absmax.reshape(-1).float(), shape=torch.Size((count * shape[0], *shape[1:])),
                       code=getattr(module, f"{name}_code"), blocksize=blocksize, quant_type=module.quant_type,
                       dtype=module.dtype)  # fmt: skip
    return dequantize_4bit(packed, state).view(count, *shape)  # count x shape[0] rows, as bitsandbytes sees it


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    out = grouped_mm_function()(a, b, offs=offs)
    if out.requires_grad:  # its backward refuses an expanded gradient ("Invalid strides/sizes", e.g. after .sum())
        out.register_hook(_contiguous)
    return out


class _Routing:
    """The routed rows of one forward sorted by expert: what every projection of the layer shares."""

    def __init__(self, top_k_index: torch.Tensor, num_experts: int):
        with torch.no_grad():
            flat = top_k_index.reshape(-1)
            # num_experts + 1 classes: some routers mark dropped slots with index num_experts; they sort last.
            counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
            order = torch.argsort(flat, stable=True)[: int(counts.sum())]
            self.tokens, self.slots = order // top_k_index.shape[1], order % top_k_index.shape[1]
            self.experts = counts.nonzero().flatten()  # the routed experts, ascending: the loop's order
            self.offsets = counts[self.experts].cumsum(0).to(torch.int32)  # groups over the routed experts
            self.all_offsets = counts.cumsum(0).to(torch.int32)  # groups over every expert (LoRA's views)
            self.row_expert = flat[order]
        self.num_experts = num_experts


def _project(module, index: int, x: torch.Tensor, routing: _Routing) -> torch.Tensor:
    name = module.layout.weights[index]
    weight = dequantize_routed(module, name, routing.experts)
    out = _grouped_mm(x, weight if module.layout.transposed else weight.transpose(-2, -1), routing.offsets)
    del weight  # autograd keeps it for the input gradient (what the doctor plans as the saved experts)
    if module.layout.biases:
        out = out + getattr(module, module.layout.biases[index])[routing.row_expert]
    rows = module.expert_rows(name)  # past the routed experts: LongCat-Flash's zero experts, never routed here
    for lora_A, lora_B, scaling in module.lora_factors(name):
        low = run_with_weight(lora_A, _lora_A_grouped, x, routing, rows)
        delta = run_with_weight(lora_B, _lora_B_grouped, low, routing, rows)
        out = out + scaling * delta.to(out.dtype)
    return out


def _rank_padding(rank: int, dtype: torch.dtype) -> int:
    per_row = 16 // torch.empty((), dtype=dtype).element_size()
    return -rank % per_row


def _lora_A_grouped(weight, x, routing, rows):
    # peft's lora_A for [E, out, in] is [r*E, in]: expert e's rows are e*r .. e*r+r-1, i.e. weight viewed [E, r, in].
    per_expert = weight.unflatten(0, (rows, -1))[: routing.num_experts]
    per_expert = torch.nn.functional.pad(per_expert, (0, 0, 0, _rank_padding(per_expert.shape[1], weight.dtype)))
    return _grouped_mm(x.to(weight.dtype), per_expert.transpose(-2, -1), routing.all_offsets)


def _lora_B_grouped(weight, low, routing, rows):
    # peft's lora_B is [out, r*E] read as [out, r, E]: expert e's columns are e, E+e, 2E+e, ...; low is padded.
    per_expert = weight.unflatten(1, (-1, rows)).permute(2, 0, 1)[: routing.num_experts]
    per_expert = torch.nn.functional.pad(per_expert, (0, low.shape[1] - per_expert.shape[2])).contiguous()
    return _grouped_mm(low.to(weight.dtype), per_expert.transpose(-2, -1), routing.all_offsets)


def grouped_forward(module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The experts' output ``[T, H]`` for `hidden` ``[T, H]`` routed by `top_k_index` / `top_k_weights` ``[T, k]``."""
    routing = _Routing(top_k_index, module.num_experts)
    final = torch.zeros_like(hidden)
    if not routing.experts.numel():
        return final
    out = module.apply_gate(_project(module, 0, hidden[routing.tokens], routing))
    out = module.post_expert(_project(module, 1, out, routing)) * top_k_weights[routing.tokens, routing.slots, None]
    # One index_add_ in expert order: each token's contributions add in the loop's order.
    return final.index_add_(0, routing.tokens, out.to(final.dtype))
