"""The dtype rules, in one place.

Under FSDP every parameter of one unit is flattened (FSDP1) or sharded and all-gathered (FSDP2)
together, so one QLoRA model needs one floating dtype for its frozen tensors:

* the 4-bit weights are stored packed inside a tensor of ``bnb_4bit_quant_storage`` dtype. That dtype
  must be floating (FSDP1 cannot flatten integers: "Cannot flatten integer dtype tensors"), and FSDP's
  mixed-precision ``param_dtype`` must equal it, or FSDP casts the packed bytes and corrupts them;
* the compute dtype and the dtype of every other frozen parameter (embeddings, norms, biases, heads) must
  be that same dtype. ``prepare_model_for_kbit_training`` upcasts norms to fp32; beside a bf16 base that
  gives "Must flatten tensors with uniform dtype".

Per kind of tensor (storage / compute / what the optimizer steps):

================================  ================  ==============  ==========================
tensor                            storage           compute         optimizer
================================  ================  ==============  ==========================
packed 4-bit / int8 weights       training dtype    training dtype  frozen (bytes, never cast)
other frozen (norms, embeddings)  training dtype    training dtype  frozen
trainable (LoRA A/B, DoRA         float32           training dtype  float32 (and its states)
magnitudes, modules_to_save)      (``adapter_dtype``: FSDP gathers them cast, or autocast casts)
================================  ================  ==============  ==========================

The trainable tensors are float32 by default because a bf16 weight rounds away Adam steps smaller than
half its last place (:mod:`hf_fsdp_qlora.train.precision` owns this; ``adapter_dtype="bfloat16"`` opts
out). FSDP still sees one dtype where it needs one: FSDP2 requires it among a group's *trainable*
parameters only, and under FSDP1 every trainable leaf module is a unit of its own (peft's wrap policy).
The saved adapter is peft's format in the adapter dtype (float32 by default, as stock peft's).

Buffers (rotary ``inv_freq``) are not parameters and keep their dtype.

A frozen parameter that transformers loads in float32 into a 16-bit model (``_keep_in_fp32_modules_strict``:
Inkling 2's router weight, which its forward multiplies by float32 hidden states uncast) is stored in the training
dtype like the rest, and upcast for its module's forward only (:func:`keep_float32_compute`), as the class computes it.
"""

from __future__ import annotations

import torch

from .dtype_names import ALIASES, FLOAT_NAMES, canonical_name

__all__ = [
    "FLOAT_DTYPES",
    "is_int8",
    "is_params4bit",
    "is_packed_experts",
    "is_int8_bytes",
    "INT8_BYTES_ATTR",
    "resolve_dtype",
    "quantization_kind",
    "quant_storage_dtype",
    "training_dtype",
    "harmonize_dtypes",
    "keep_float32_compute",
    "view_packed_storage_as",
]

# every accepted name and alias -> torch dtype (the names live in dtype_names, which needs no torch)
FLOAT_DTYPES = {
    name: getattr(torch, canonical_name(name))
    for name in (*FLOAT_NAMES, *ALIASES)
    if canonical_name(name) in FLOAT_NAMES
}


def resolve_dtype(dtype) -> torch.dtype:
    """Turn ``"bfloat16"``/``"bf16"``/``torch.bfloat16`` into a floating ``torch.dtype``.

    Raises:
        ValueError: for anything that is not bfloat16, float16 or float32.
    """
    if isinstance(dtype, torch.dtype) and dtype in FLOAT_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in FLOAT_DTYPES:
        return FLOAT_DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype={dtype!r} is not supported: use one of 'bfloat16', 'float16' or 'float32'.")


def is_params4bit(param) -> bool:
    return type(param).__name__ == "Params4bit"


# Set on the packed expert bytes of experts/quantized.py: they are bytes, not values, like a Params4bit's.
PACKED_EXPERTS_ATTR = "_hf_fsdp_qlora_packed_experts"


def is_packed_experts(param) -> bool:
    return getattr(param, PACKED_EXPERTS_ATTR, False)


def is_int8(param) -> bool:
    return type(param).__name__ == "Int8Params"


# Set on the int8 weight bytes of loading/int8.py's Int8Linear, viewed as the training dtype: bytes, not values.
INT8_BYTES_ATTR = "_hf_fsdp_qlora_int8_bytes"


def is_int8_bytes(param) -> bool:
    return getattr(param, INT8_BYTES_ATTR, False)


def _int8_storage_dtype(model) -> torch.dtype | None:
    """The dtype the int8 bytes of an 8-bit base are viewed as (loading/int8.py), or None without them."""
    dtypes = {param.dtype for param in model.parameters() if is_int8_bytes(param)}
    if len(dtypes) > 1:
        raise ValueError(f"The 8-bit weights are viewed as several dtypes ({sorted(map(str, dtypes))}): load once.")
    return dtypes.pop() if dtypes else None


def quantization_kind(model) -> str | None:
    """``"4bit"``, ``"8bit"`` or ``None``, from the parameters themselves (works on peft-wrapped models)."""
    for param in model.parameters():
        if is_params4bit(param):
            return "4bit"
        if is_int8(param):
            return "8bit"
    return None


def quant_storage_dtype(model) -> torch.dtype | None:
    """The dtype the packed 4-bit weights are stored in, or ``None`` for a model without 4-bit weights.

    Raises:
        ValueError: if the 4-bit weights use more than one storage dtype.
    """
    dtypes = {param.dtype for param in model.parameters() if is_params4bit(param)}
    if not dtypes:
        return None
    if len(dtypes) > 1:
        names = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(
            f"The 4-bit weights are stored in several dtypes ({names}). Load the model with one "
            "BitsAndBytesConfig(bnb_4bit_quant_storage=...) - hf_fsdp_qlora.load_qlora_model does this."
        )
    return dtypes.pop()


def _configured_compute_dtype(model) -> torch.dtype | None:
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    value = getattr(config, "bnb_4bit_compute_dtype", None)
    if value is None and isinstance(config, dict):
        value = config.get("bnb_4bit_compute_dtype")
    if value is None:
        return None
    try:
        return resolve_dtype(value)
    except ValueError:
        return None


def training_dtype(model) -> torch.dtype:
    """The one floating dtype every FSDP unit of `model` should use.

    It is the 4-bit storage dtype when that is floating; for an 8-bit base the dtype its int8 bytes are viewed as
    (loading/int8.py), or before that the model's floating dtype; for integer 4-bit storage (FSDP2 only) the compute
    dtype; for a model without quantized weights the dtype of its first floating parameter.
    """
    storage = quant_storage_dtype(model)
    if storage is not None and storage.is_floating_point:
        return storage
    # An 8-bit base: the dtype its int8 bytes are viewed as, or (not converted yet) the model's floating dtype;
    # its quantization_config's bnb_4bit_compute_dtype is a 4-bit setting that 8-bit loading leaves at float32.
    int8_storage = _int8_storage_dtype(model)
    if int8_storage is not None:
        return int8_storage
    if storage is None and quantization_kind(model) == "8bit":
        return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    compute = _configured_compute_dtype(model)
    if compute is not None:
        return compute
    for param in model.parameters():
        if param.is_floating_point() and not is_params4bit(param):
            return param.dtype
    return torch.float32


def harmonize_dtypes(model, dtype: torch.dtype, trainable_dtype: torch.dtype | None = None) -> list[str]:
    """Cast every floating, non-quantized parameter of `model` to `dtype` (the trainable ones to `trainable_dtype`
    when given: float32 master weights, see the table above), in place.

    Covers LoRA adapters upcast by peft, norms upcast by ``prepare_model_for_kbit_training``, biases,
    embeddings and heads. Packed 4-bit weights are never touched (their bytes are not values), and
    bitsandbytes' compute dtype is set to `dtype` so matmuls run in the same precision.

    Returns:
        The names of the parameters that were cast.
    """
    changed = []
    for name, param in model.named_parameters():
        # Packed 4-bit expert bytes (experts/quantized.py) are not values either: a float cast corrupts them.
        if is_params4bit(param) or is_int8(param) or not param.is_floating_point() or is_packed_experts(param):
            continue
        if is_int8_bytes(param):  # 8-bit weight bytes (loading/int8.py): a float cast corrupts them too
            continue
        target = trainable_dtype if trainable_dtype is not None and param.requires_grad else dtype
        if param.dtype != target:
            param.data = param.data.to(target)
            changed.append(name)
    for module in model.modules():
        if type(module).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4") and hasattr(module, "compute_dtype"):
            module.compute_dtype = dtype
    return changed


_FLOAT32_SAVED = "_hf_fsdp_qlora_float32_saved"


def keep_float32_compute(model, dtype: torch.dtype) -> list[str]:
    """Before :func:`harmonize_dtypes` casts them to the 16-bit `dtype`: for every frozen float32 parameter of
    `model` (one transformers kept in float32, ``_keep_in_fp32_modules(_strict)``), hooks on its module that upcast
    it to float32 for that module's forward (as the class computes it), and put the stored one back after it (it
    stays `dtype` at rest: one dtype for FSDP). A linear layer's input is upcast too: its caller may cast it to the
    weight's dtype it reads outside the forward (HY-V4's ``lm_head(h.to(lm_head.weight.dtype))``), which is `dtype`
    at rest; other modules (norms) get their input as the class gives it. Modules holding 4-bit bytes are left as
    they are. Returns the parameters' names."""
    kept_modules = _kept_in_float32(model)
    if dtype == torch.float32 or not kept_modules:
        return []
    names = []
    for module_name, module in model.named_modules():
        own = {  # float32 by accident of loading (XLNet's q/k/v) is not kept: harmonize_dtypes casts it, as before
            n: p
            for n, p in module.named_parameters(recurse=False)
            if any(k in (f"{module_name}.{n}" if module_name else n) for k in kept_modules)
        }
        if any(is_params4bit(p) or is_packed_experts(p) for p in own.values()):
            continue
        kept = tuple(n for n, p in own.items() if p.dtype == torch.float32 and not p.requires_grad)
        if kept:
            linear = isinstance(module, torch.nn.Linear) and "weight" in kept
            module.register_forward_pre_hook(lambda m, args, kept=kept, linear=linear: _upcast(m, kept, args, linear))
            module.register_forward_hook(lambda m, args, output: _put_back(m), always_call=True)
            names += [f"{module_name}.{n}" if module_name else n for n in kept]
    return names


def _kept_in_float32(model) -> set[str]:
    """The module names the model's class keeps in float32 (``_keep_in_fp32_modules`` and ``..._strict``, read as
    transformers reads them: a part of the parameter's full name, "mlp.gate.weight")."""
    kept = set()
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        kept |= set(getattr(model, attr, None) or [])
    return kept


def _upcast(module, kept: tuple[str, ...], args: tuple, linear: bool) -> tuple | None:
    # read at each forward, so the tensor FSDP has put in place (the gathered one) is the one upcast
    # (a wrapper that holds the tensor outside the slot, FSDP1 without use_orig_params: left as it is)
    saved = {n: module._parameters[n] for n in kept if module._parameters.get(n) is not None}
    setattr(module, _FLOAT32_SAVED, saved)
    for n, param in saved.items():
        module._parameters[n] = param.float()  # a plain tensor in the slot for this forward only
    if not linear:
        return None  # the inputs as given
    return tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _put_back(module) -> None:
    module._parameters.update(getattr(module, _FLOAT32_SAVED, None) or {})
    setattr(module, _FLOAT32_SAVED, None)


@torch.no_grad()
def view_packed_storage_as(model, dtype: torch.dtype) -> int:
    """Re-type 4-bit storage of another dtype (integer, or a pre-quantized checkpoint's) as `dtype` by viewing the
    same bytes, so FSDP can shard it with the rest of the model.

    bitsandbytes packs two 4-bit codes per byte; ``bnb_4bit_quant_storage`` only decides which dtype the
    packed bytes are *viewed* as (it reads them back as bytes), so a uint8-stored weight of 2n bytes and
    a bf16-stored weight of n elements hold the same bits. accelerate's FSDP2 leaves integer-stored
    weights out of sharding (a full copy on every GPU); viewed as `dtype` they shard like any other
    parameter. No value is converted: the packed bytes, NaN/Inf/subnormal bit patterns included, are
    untouched. Parameters whose byte count is not a multiple of the new element size stay as they are.

    Returns:
        How many weights were re-typed.
    """
    if not dtype.is_floating_point:
        raise ValueError(f"view_packed_storage_as needs a floating dtype, got {dtype}")
    width = torch.tensor([], dtype=dtype).element_size()
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not is_params4bit(weight) or weight.dtype == dtype:
            continue
        flat = weight.data.reshape(-1)
        if (flat.numel() * flat.element_size()) % width:
            continue
        weight.data = flat.view(torch.uint8).view(dtype).reshape(-1, 1)
        weight.quant_storage = dtype
        if hasattr(module, "quant_storage"):
            module.quant_storage = dtype
        count += 1
    return count
