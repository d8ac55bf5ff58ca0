"""What a ``dequantize`` merge round-trips with: the quant settings training used, from what says so, never a guess.

In order: the adapter's quantization record (:mod:`hf_fsdp_qlora.quant_record`, written by every adapter save of
``load_qlora_model`` models and of our trainers and callback); else the ``quantization_config`` of the pre-quantized
checkpoint that ``adapter_config.json`` names as its base (a local folder); else the caller's explicit
``double_quant``. A 4-bit merge with none of them is refused: bitsandbytes' ``BitsAndBytesConfig`` and trl's
``--load_in_4bit`` default to no double quant, ``load_qlora_model`` to double quant, and the two round trips differ in
about one weight in ten. An explicit setting that contradicts the record or the checkpoint is refused too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hf_fsdp_qlora.errors import MergeUsageError
from hf_fsdp_qlora.merge.adapter_io import read_quant_record
from hf_fsdp_qlora.quant_record import RECORD_NAME, QuantRecord

__all__ = ["QuantSettings", "quant_settings"]

_DEFAULT_BLOCKSIZE = 64  # bitsandbytes' 4-bit block size; transformers' BitsAndBytesConfig has no option for it


@dataclass(frozen=True)
class QuantSettings:
    record: QuantRecord | None  # the adapter's record: exactly its tensors are round-tripped
    double_quant: bool
    blocksize: int
    skip_modules: tuple[str, ...] = ()  # a pre-quantized base's llm_int8_skip_modules (transformers' rule otherwise)


def _prequantized_config(adapter_config: dict) -> tuple[Path, dict] | None:
    """(folder, its bitsandbytes quantization_config) of the local pre-quantized checkpoint the adapter names as
    its base (``base_model_name_or_path``), or None."""
    name = adapter_config.get("base_model_name_or_path")
    folder = Path(name) if name else None
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        config = json.loads((folder / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(config, dict) or config.get("quant_method", "bitsandbytes") != "bitsandbytes":
        return None
    if not (config.get("load_in_4bit") or config.get("load_in_8bit")):
        return None
    return folder, config


def _check_agrees(what: str, source: str, said, double_quant, blocksize, said_blocksize) -> None:
    if double_quant is not None and double_quant != said:
        raise MergeUsageError(
            f"`double_quant={double_quant}` contradicts {source}, which says training used "
            f"bnb_4bit_use_double_quant={said}: leave `double_quant` out ({what} decides)"
        )
    if blocksize is not None and said_blocksize is not None and blocksize != said_blocksize:
        raise MergeUsageError(
            f"`quant_blocksize` {blocksize} contradicts {source}, which says training used block size "
            f"{said_blocksize}: leave `quant_blocksize` out ({what} decides)"
        )


def _from_checkpoint(found, dequantize, double_quant, blocksize) -> QuantSettings:
    folder, config = found
    trained = "int8" if config.get("load_in_8bit") else config.get("bnb_4bit_quant_type", "fp4")
    source = f"the quantization_config of {folder / 'config.json'} (the adapter's base_model_name_or_path)"
    if trained != dequantize:
        raise MergeUsageError(
            f"`dequantize` {dequantize} does not match training: {source} quantizes {trained}. "
            f"Pass `dequantize={trained!r}`."
        )
    said = bool(config.get("bnb_4bit_use_double_quant", False)) if trained != "int8" else False
    if trained != "int8":
        _check_agrees("the checkpoint", source, said, double_quant, None, None)
    skip = tuple(config.get("llm_int8_skip_modules") or ())
    return QuantSettings(None, said, blocksize or _DEFAULT_BLOCKSIZE, skip)


def quant_settings(folder: Path, adapter_config: dict, dequantize, double_quant, blocksize) -> QuantSettings:
    """The settings a merge with `dequantize` round-trips with (see the module's docstring for the order).

    Raises:
        MergeUsageError: a 4-bit merge without a record, a pre-quantized base or `double_quant`; or a
            `dequantize` / `double_quant` / `quant_blocksize` that contradicts what the adapter's files say.
    """
    record = read_quant_record(folder, dequantize)
    if record is not None:
        if record.bits == 4:
            _check_agrees("the record", folder / RECORD_NAME, record.double_quant, double_quant, blocksize,
                          record.blocksize)  # fmt: skip
        return QuantSettings(record, record.double_quant, record.blocksize or _DEFAULT_BLOCKSIZE)
    if dequantize:
        found = _prequantized_config(adapter_config)
        if found is not None:
            return _from_checkpoint(found, dequantize, double_quant, blocksize)
    if dequantize in ("nf4", "fp4") and double_quant is None:
        raise MergeUsageError(
            f"`dequantize` {dequantize} needs to know whether training used double quant, and nothing says: "
            f"{folder} has no quantization record ({RECORD_NAME}, which adapters saved by load_qlora_model, "
            "FSDPQLoRATrainer, FSDPQLoRASFTTrainer, FSDPQLoRACallback or hf_fsdp_qlora.run carry) and its "
            "adapter_config.json names no local pre-quantized base. Pass `double_quant=False` if the base was "
            "loaded with bnb_4bit_use_double_quant=False (BitsAndBytesConfig's default, trl's --load_in_4bit), "
            "`double_quant=True` if with double quant (load_qlora_model's default, trl's --use_bnb_nested_quant)"
        )
    return QuantSettings(None, bool(double_quant), blocksize or _DEFAULT_BLOCKSIZE)
