"""8-bit bases under FSDP: bitsandbytes' int8 linear layers as a module FSDP can flatten and shard.

bitsandbytes keeps an 8-bit weight as ``Int8Params``: an ``int8`` tensor with its per-row scales (``SCB``, one
float32 absmax per output row) as a Python attribute. FSDP1 cannot flatten it ("Cannot flatten integer dtype
tensors"), and FSDP2 builds a new parameter when it shards and loses the attribute ("'Parameter' object has no
attribute 'CB'"). :class:`Int8Linear` holds the same two tensors in the form FSDP handles:

* ``weight``: the int8 bytes *viewed* as the run's one floating dtype (``[out, in * 1 / itemsize]``: a bf16
  element holds two int8 values). A frozen parameter that FSDP1 flattens with the rest of its unit and FSDP2
  shards by rows, 1/N per rank. Bytes, never values: it is marked so :func:`~hf_fsdp_qlora.dtypes.harmonize_dtypes`
  never casts it, and FSDP's mixed-precision param dtype equals it, so FSDP moves it without converting.
* ``SCB``: the float32 row scales as a buffer, whole on every rank (4 bytes per output row: 0.05% of a 8192-wide
  weight). FSDP1 and FSDP2 leave buffers where they are (CPU offload moves parameters, not buffers), so every rank
  has the scales of the rows it all-gathers. Its state-dict key is bitsandbytes' own (``<layer>.SCB``).

The forward dequantizes the gathered weight row by row (``int8 * SCB / 127``, in float32, then the compute dtype)
and multiplies in the compute dtype; the backward dequantizes again instead of keeping a 16-bit copy per layer.
bitsandbytes' LLM.int8() matmul also quantizes the *activations* to int8 and computes only the "outlier" columns
(any value above ``llm_int8_threshold``) in 16 bits against the dequantized weight; here every column is computed
that way, so ``llm_int8_threshold`` has no effect: the only quantization error is the weight's.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..dtypes import INT8_BYTES_ATTR
from ..errors import UnsupportedSetupError
from ._transfer import _ROWS_ATTR

__all__ = ["Int8Linear", "convert_int8_layers", "int8_layer_count", "keep_int8_scales", "modules_kept_16bit"]

logger = logging.getLogger(__name__)

_INV_127 = 1.0 / 127  # bitsandbytes' row-wise int8: value = code * absmax / 127


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def dequantize(weight: torch.Tensor, scales: torch.Tensor, out_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` weight in `dtype` from its int8 bytes (viewed as any dtype) and float32 row scales."""
    codes = weight.contiguous().reshape(-1).view(torch.int8).reshape(out_features, -1)
    return (codes.to(torch.float32) * (scales.to(torch.float32) * _INV_127)[:, None]).to(dtype)


class _Int8Matmul(torch.autograd.Function):
    """``x @ dequantize(W).T``, keeping the int8 bytes (not a 16-bit copy) for the backward."""

    @staticmethod
    def forward(ctx, x, weight, scales, out_features):
        ctx.save_for_backward(weight, scales)
        ctx.out_features = out_features
        return F.linear(x, dequantize(weight, scales, out_features, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        weight, scales = ctx.saved_tensors
        grad_x = grad @ dequantize(weight, scales, ctx.out_features, grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class Int8Linear(nn.Module):
    """A frozen linear layer with int8 weights and float32 row scales, held so FSDP can shard it (module docstring)."""

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, scales: torch.Tensor, bias=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(weight, requires_grad=False)
        setattr(self.weight, INT8_BYTES_ATTR, True)  # harmonize_dtypes never casts it
        self.register_buffer("SCB", scales)
        self.bias = bias

    @classmethod
    def from_bnb(cls, layer, dtype: torch.dtype, name: str = "") -> Int8Linear:
        """The same int8 codes and scales as bitsandbytes' ``Linear8bitLt`` `layer`, bytes viewed as `dtype`."""
        weight = layer.weight
        if getattr(layer.state, "has_fp16_weights", False) or weight.dtype != torch.int8:
            raise UnsupportedSetupError(
                f"{name or 'An 8-bit layer'} holds {weight.dtype} weights, not int8 (llm_int8_has_fp16_weights=True "
                "keeps 16-bit weights and re-quantizes them at every step): hf_fsdp_qlora trains LoRA on a frozen "
                "int8 base. Load with BitsAndBytesConfig(load_in_8bit=True) and llm_int8_has_fp16_weights=False "
                "(the default), e.g. load_qlora_model(path, bits=8)."
            )
        scales = getattr(weight, "SCB", None)
        if scales is None:  # moved to the layer's state by its first forward, or received as a buffer (low_ram)
            scales = layer.state.SCB if layer.state.SCB is not None else getattr(layer, "SCB", None)
        out_features, in_features = weight.shape
        _viewed_width(in_features, dtype, name)
        data = weight.data.contiguous().view(dtype)
        bias = layer.bias
        if bias is not None:
            bias = nn.Parameter(bias.data.to(dtype), requires_grad=bias.requires_grad)
        converted = cls(in_features, out_features, data, scales.to(torch.float32), bias)
        if hasattr(layer, _ROWS_ATTR):  # the rows this rank received (low_ram): the same rows, the same bytes
            object.__setattr__(converted, _ROWS_ATTR, getattr(layer, _ROWS_ATTR))
        return converted

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        out = _Int8Matmul.apply(x.to(dtype), self.weight, self.SCB, self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(dtype)
        return out

    def __getattr__(self, name: str):
        if name == "state":  # what peft's 8-bit merge/unmerge and DoRA read from a bitsandbytes layer
            raise AttributeError(
                "'Int8Linear' object has no attribute 'state': this 8-bit layer holds its int8 bytes for FSDP "
                "(hf_fsdp_qlora.loading.int8), not as bitsandbytes' Linear8bitLt, so peft cannot merge into it "
                "(merge_and_unload). Save the adapter and merge it into the 16-bit base with merge-adapters."
            )
        return super().__getattr__(name)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _viewed_width(in_features: int, dtype: torch.dtype, name: str) -> int:
    """How many `dtype` elements hold one row of `in_features` int8 codes."""
    width = torch.empty((), dtype=dtype).element_size()
    if in_features % width:
        short = (name or "its name").rsplit(".", 1)[-1]
        raise UnsupportedSetupError(
            f"{name or 'An 8-bit layer'} has in_features={in_features}, not a multiple of {width}: its int8 rows "
            f"cannot be viewed as {dtype} for FSDP. "
            + (
                "Train this model with dtype=torch.bfloat16 (2 bytes per element)."
                if in_features % 2 == 0
                else f"Keep this layer 16-bit: load_qlora_model(path, bits=8, skip_modules=[{short!r}]) (transformers' "
                f"own skips, such as the output head, are kept), and merge with merge-adapters --dequantize int8 "
                f"--skip-modules {short}. A model loaded by hand: BitsAndBytesConfig(load_in_8bit=True, "
                f"llm_int8_skip_modules=['lm_head', {short!r}]) (that list replaces transformers' own: name the output "
                "head too). Or load the model in 4 bits (bits=4; trl: --load_in_4bit, as --load_in_8bit has no skip "
                "option)."
            )
        )
    return in_features // width


def modules_kept_16bit(config, skip_modules, dtype, trust_remote_code: bool = False, model=None) -> list[str]:
    """bitsandbytes' ``llm_int8_skip_modules`` for `skip_modules` added to transformers' own list.

    A ``llm_int8_skip_modules`` given to transformers REPLACES the list it builds itself (the output head, tied
    weights), which would then be quantized: so that list is read from the model built on the meta device (nothing
    allocated; `model` when the caller has built it already, e.g. of an image-text class) and `skip_modules` is
    appended to it.
    """
    from transformers.quantizers.base import get_keys_to_not_convert

    from ..experts.placement import _meta_model

    defaults = get_keys_to_not_convert(model if model is not None else _meta_model(config, dtype, trust_remote_code))
    return sorted(set(defaults)) + [name for name in skip_modules if name not in defaults]


def keep_int8_scales(model) -> int:
    """Register each bitsandbytes ``Linear8bitLt``'s row scales as its buffer ``SCB`` (meta-device skeletons: an
    empty one of the same shape), so a transfer that moves parameters and buffers moves them too.

    bitsandbytes keeps them as an attribute of the weight (``weight.SCB``), which loading/low_ram.py's rank-to-rank
    transfer would not see; :func:`convert_int8_layers` reads the buffer when the weight has none.
    """
    linear8 = _bnb_linear8()
    count = 0
    for module in model.modules():
        if linear8 is None or not isinstance(module, linear8):
            continue
        scales = getattr(module.weight, "SCB", None)
        if scales is None:
            scales = module.state.SCB
        if scales is None and module.weight.is_meta:
            scales = torch.empty(module.weight.shape[0], dtype=torch.float32, device="meta")
        module.register_buffer("SCB", scales)
        count += 1
    return count


def _bnb_linear8():
    try:
        import bitsandbytes as bnb
    except ImportError:  # no bitsandbytes: no 8-bit layer can exist
        return None
    return bnb.nn.Linear8bitLt


def int8_layer_count(model) -> int:
    """How many bitsandbytes ``Linear8bitLt`` layers `model` still holds (peft's wrappers are not counted)."""
    linear8 = _bnb_linear8()
    return 0 if linear8 is None else sum(isinstance(m, linear8) for m in model.modules())


@torch.no_grad()
def convert_int8_layers(model, dtype: torch.dtype) -> int:
    """Replace every bitsandbytes ``Linear8bitLt`` in `model` (bare, or as a peft LoRA layer's base) by
    :class:`Int8Linear` with the same int8 codes and scales. No value changes; idempotent.

    Returns:
        How many layers were replaced.

    Raises:
        UnsupportedSetupError: a layer keeps 16-bit weights (``llm_int8_has_fp16_weights=True``) or its rows cannot
            be viewed as `dtype`.
    """
    linear8 = _bnb_linear8()
    if linear8 is None:
        return 0
    found = [
        (parent, child_name, child, f"{name}.{child_name}".lstrip("."))
        for name, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if isinstance(child, linear8)
    ]
    if not found:
        return 0
    dora = [name for parent, _, _, name in found if len(getattr(parent, "lora_magnitude_vector", None) or ())]
    if dora:
        # peft's DoRA re-reads the base weight each step through its own bitsandbytes dequantization, which would read
        # the viewed bytes of Int8Linear as values: refuse rather than train on garbage.
        raise UnsupportedSetupError(
            f"DoRA (use_dora=True) on an 8-bit base is not supported under FSDP ({len(dora)} layers, e.g. {dora[0]}): "
            "peft's DoRA reads the int8 weight through bitsandbytes' own state. Use plain LoRA on the 8-bit base "
            "(use_dora=False), or DoRA on a 4-bit base: load_qlora_model(path, bits=4, lora_config=...)."
        )
    thresholds = sorted({float(getattr(child.state, "threshold", 0.0)) for _, _, child, _ in found})
    for parent, child_name, child, name in found:
        setattr(parent, child_name, Int8Linear.from_bnb(child, dtype, name))
    logger.info(
        "hf_fsdp_qlora: %d bitsandbytes 8-bit layers now hold their int8 bytes as %s for FSDP (row scales kept as "
        "buffers); every activation column is computed in the compute dtype, so llm_int8_threshold=%s has no effect",
        len(found), dtype, thresholds,
    )  # fmt: skip
    return len(found)
