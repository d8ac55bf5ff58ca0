"""Pre-quantized checkpoints: what a saved model's ``quantization_config`` says, and whether a run can use it.

A model saved after bitsandbytes 4-bit loading (what the shared ``*-bnb-4bit`` repos are) holds packed 4-bit
bytes and their quant states, and its ``config.json`` carries the ``quantization_config`` they were made with.
transformers always loads such a checkpoint with that config (a ``quantization_config`` passed to
``from_pretrained`` is ignored with a warning), so the quantization is the checkpoint's, never the caller's.
Its storage dtype is bitsandbytes' default ``uint8`` unless it was saved otherwise; the packed bytes are then
*viewed* as the run's dtype (:func:`hf_fsdp_qlora.dtypes.view_packed_storage_as`), never re-quantized.

Torch-free (:func:`checkpoint_tensor_names` imports torch when called): the loader and the doctor both ask it,
before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dtype_names import BYTES, canonical_name
from .errors import UnsupportedSetupError

__all__ = [
    "CheckpointQuantization",
    "checkpoint_quantization",
    "checkpoint_tensor_names",
    "quantized_bits",
    "refuse_saved_quantized_experts",
    "refuse_unviewable_storage",
    "saved_quantized_experts",
]

# Storage dtypes whose packed bytes we view as the run's dtype (bitsandbytes accepts any of these).
_STORAGE_BYTES = {**BYTES, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4}


@dataclass(frozen=True)
class CheckpointQuantization:
    """The 4-bit quantization a checkpoint was saved with (its ``config.json``'s ``quantization_config``)."""

    quant_type: str  # "nf4" or "fp4"
    double_quant: bool
    storage: str  # dtype name of the saved packed bytes ("uint8" unless saved otherwise)
    compute: str | None


def _get(qconfig, key, default=None):
    if isinstance(qconfig, dict):
        return qconfig.get(key, default)
    return getattr(qconfig, key, default)


def _qconfig(config):
    return (
        config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    )


def _method(qconfig) -> str:
    return str(_get(qconfig, "quant_method", "bitsandbytes")).lower().rsplit(".", 1)[-1]


def quantized_bits(config) -> int | None:
    """4 or 8 for a checkpoint pre-quantized by bitsandbytes, ``None`` otherwise (not quantized, or another method)."""
    qconfig = _qconfig(config)
    if not qconfig or _method(qconfig) != "bitsandbytes":
        return None
    if _get(qconfig, "load_in_8bit") or _get(qconfig, "_load_in_8bit"):
        return 8
    return 4 if _get(qconfig, "load_in_4bit") or _get(qconfig, "_load_in_4bit") else None


def checkpoint_quantization(config, *, allow_8bit: bool = False) -> CheckpointQuantization | None:
    """The 4-bit quantization `config` (a transformers config or its dict) was saved with; ``None`` if not quantized.

    With `allow_8bit` (``load_qlora_model(bits=8)``) an 8-bit bitsandbytes checkpoint passes (``None``: no 4-bit
    quantization to keep); it is loaded by bitsandbytes and its int8 layers converted like a fresh 8-bit load.

    Raises:
        UnsupportedSetupError: the checkpoint is quantized in a way FSDP QLoRA cannot train (8-bit
            bitsandbytes without `allow_8bit`, another quantization method, or a storage dtype bitsandbytes does
            not write).
    """
    qconfig = _qconfig(config)
    if not qconfig:
        return None
    method = _method(qconfig)
    if method != "bitsandbytes":
        raise UnsupportedSetupError(
            f"This checkpoint is pre-quantized with quant_method={method!r}; hf_fsdp_qlora trains bitsandbytes 4-bit "
            "bases only. Load the original 16-bit checkpoint with load_qlora_model(path, dtype=torch.bfloat16): "
            "it quantizes it in 4 bits itself."
        )
    bits = quantized_bits(config)
    if bits == 8 and allow_8bit:
        return None
    if bits == 8:
        raise UnsupportedSetupError(
            "This checkpoint is pre-quantized in 8 bits (its config.json has quantization_config.load_in_8bit=true), "
            "and 4 bits were asked for: its int8 weights cannot be re-quantized to 4 bits. Load it with "
            "load_qlora_model(path, bits=8), which trains LoRA on the 8-bit base under FSDP, or load the original "
            "16-bit checkpoint with load_qlora_model(path) (4-bit NF4)."
        )
    if bits != 4:
        return None
    storage = canonical_name(_get(qconfig, "bnb_4bit_quant_storage") or "uint8")
    if storage not in _STORAGE_BYTES:
        raise UnsupportedSetupError(
            f"This 4-bit checkpoint stores its packed weights as {storage!r}, a dtype whose bytes cannot be viewed as "
            "the model's floating dtype, so FSDP cannot flatten them with the rest of the model. Re-save it with "
            "BitsAndBytesConfig(bnb_4bit_quant_storage=torch.bfloat16), or load the original 16-bit checkpoint "
            "with load_qlora_model(path, dtype=torch.bfloat16)."
        )
    compute = _get(qconfig, "bnb_4bit_compute_dtype")
    return CheckpointQuantization(
        quant_type=str(_get(qconfig, "bnb_4bit_quant_type", "fp4")),
        double_quant=bool(_get(qconfig, "bnb_4bit_use_double_quant", False)),
        storage=storage,
        compute=canonical_name(compute) if compute is not None else None,
    )


def packed_bytes(numel: int) -> int:
    """Bytes bitsandbytes packs a 4-bit weight of `numel` values into (two codes per byte)."""
    return (numel + 1) // 2


def refuse_unviewable_storage(quant: CheckpointQuantization, dtype: str, weights: dict[str, int]) -> None:
    """Raise unless every packed weight of the checkpoint can be viewed as `dtype` (one FSDP dtype).

    Args:
        quant: the checkpoint's quantization.
        dtype: the run's dtype name.
        weights: quantized weight name -> number of values (from the config's shapes).

    Raises:
        UnsupportedSetupError: some weight's packed byte count is not a multiple of `dtype`'s element size, so
            it would stay ``quant.storage`` beside `dtype` parameters ("Cannot flatten integer dtype tensors").
    """
    dtype = canonical_name(dtype)
    if quant.storage == dtype:
        return
    width = BYTES[dtype]
    odd = [name for name, numel in weights.items() if packed_bytes(numel) % width]
    if odd:
        fits = [
            d
            for d in ("bfloat16", "float16", "float32")
            if all(packed_bytes(n) % BYTES[d] == 0 for n in weights.values())
        ]
        fix = f"pass dtype={fits[0]!r}" if fits else "load the original 16-bit checkpoint"
        raise UnsupportedSetupError(
            f"This 4-bit checkpoint stores its packed weights as {quant.storage!r}, and the packed bytes of "
            f"{len(odd)} weight(s) (e.g. {odd[0]}) are not a multiple of {width} bytes, so they cannot be viewed as "
            f'{dtype} and FSDP cannot flatten them with the rest of the model ("Cannot flatten integer dtype '
            f'tensors"). To train it, {fix} (load_qlora_model quantizes a 16-bit checkpoint in any dtype).'
        )


# --- mixture-of-experts checkpoints --------------------------------------------------------------------------------
# A stock 4-bit MoE checkpoint (saved after `load_in_4bit`) holds packed linear layers and 16-bit experts: the loader
# quantizes those experts as it would a 16-bit model's, with the checkpoint's quant type. A checkpoint saved from a
# model holding hf_fsdp_qlora's `QuantizedExperts` is another matter: its experts are packed bytes named
# `<experts>.<weight>_4bit`, and their quantization constants are buffers save_pretrained does not write.

PACKED_EXPERTS_SUFFIX = "_4bit"


def saved_quantized_experts(tensor_names, expert_weights) -> list[str]:
    """The tensors of a checkpoint that are hf_fsdp_qlora's packed 4-bit expert weights.

    Args:
        tensor_names: every tensor name of the checkpoint (its safetensors headers or index).
        expert_weights: the fused expert weight names we quantize (e.g. ``{"gate_up_proj", "down_proj"}``).
    """
    packed = {w + PACKED_EXPERTS_SUFFIX for w in expert_weights}
    return sorted(n for n in tensor_names if n.rsplit(".", 1)[-1] in packed)


def checkpoint_tensor_names(model_name_or_path) -> list[str]:
    """Tensor names of a local safetensors checkpoint (headers or index only, no weight read); [] for a Hub id."""
    import os
    from pathlib import Path

    from .errors import MergeError
    from .safetensors_io import checkpoint_shards, read_header  # imports torch: only when a loader asks

    folder = Path(os.path.expanduser(os.fspath(model_name_or_path)))
    try:
        shards = checkpoint_shards(folder) if folder.is_dir() else None
        if shards is None:
            return []
        files, weight_map = shards
        return list(weight_map) if weight_map else [n for f in files for n in read_header(folder / f)[0]]
    except MergeError:  # a damaged checkpoint: from_pretrained says what is wrong with it
        return []


def refuse_saved_quantized_experts(model_name_or_path, expert_weights) -> None:
    """Raise if the checkpoint was saved from a model with hf_fsdp_qlora's 4-bit experts (it cannot be restored).

    Args:
        model_name_or_path: the checkpoint (a local folder is checked from its safetensors headers; a Hub id is not).
        expert_weights: the fused expert weight names we quantize (e.g. ``{"gate_up_proj", "down_proj"}``).

    Raises:
        UnsupportedSetupError: the checkpoint holds packed expert bytes without their quantization constants;
            transformers would initialise the model's experts at random instead (its load report only lists them
            as missing), and the loader would then quantize noise.
    """
    found = saved_quantized_experts(checkpoint_tensor_names(model_name_or_path), expert_weights)
    if found:
        raise UnsupportedSetupError(
            f"This checkpoint was saved from a model with hf_fsdp_qlora's 4-bit experts: it holds {len(found)} packed "
            f"expert weight(s) (e.g. {found[0]!r}) but not their quantization constants (QuantizedExperts keeps them "
            "in buffers that save_pretrained does not write), so its experts cannot be restored; loaded anyway, "
            "transformers would initialise them at random. Load the original 16-bit checkpoint instead "
            "(load_qlora_model quantizes its experts itself). To keep a fine-tuned model, save the adapter "
            "(PeftModel.save_pretrained writes only the LoRA weights) or merge it into the 16-bit base with "
            "`merge-adapters`."
        )
