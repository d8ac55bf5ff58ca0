"""Pre-quantized checkpoints: what a saved model's ``quantization_config`` says, and whether a run can use it.

A model saved after bitsandbytes 4-bit loading (what the shared ``*-bnb-4bit`` repos are) holds packed 4-bit
bytes and their quant states, and its ``config.json`` carries the ``quantization_config`` they were made with.
transformers always loads such a checkpoint with that config (a ``quantization_config`` passed to
``from_pretrained`` is ignored with a warning), so the quantization is the checkpoint's, never the caller's.
Its storage dtype is bitsandbytes' default ``uint8`` unless it was saved otherwise; the packed bytes are then
*viewed* as the run's dtype (:func:`hf_fsdp_qlora.dtypes.view_packed_storage_as`), never re-quantized.

Torch-free: the loader and the doctor both ask it, before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from .dtype_names import BYTES, canonical_name
from .errors import UnsupportedSetupError

__all__ = ["CheckpointQuantization", "checkpoint_quantization", "quantized_bits", "refuse_unviewable_storage"]

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
