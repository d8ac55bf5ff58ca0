"""The record of what a QLoRA load quantized, which travels with the adapter so the merge round-trips exactly that.

``load_qlora_model`` records the base weights it quantized (the 4-bit or 8-bit linear weights, the 4-bit experts,
under the base model's own parameter names), the quant type, double quant, block size and bits, and bitsandbytes'
int8 skip list if one was set. Every adapter folder our save paths write gets it as :data:`RECORD_NAME` beside
``adapter_config.json``: peft's ``save_pretrained`` on the loaded model (single process, a Trainer checkpoint or
final save without FSDP) and :func:`hf_fsdp_qlora.train.checkpoint.save_adapter` (under FSDP).
``merge-adapters --dequantize`` reads it (:func:`read_record`) and round-trips those tensors and no other.

A model loaded another way (``from_pretrained(quantization_config=...)``: trl's ``--load_in_4bit``, a user's own
script) gets its record from the live model when our trainer or callback is built on it (:func:`keep_live_record`),
read off its bitsandbytes weights and their quant states, so its saved adapters carry one too.

Below loading/, train/ and merge/ (merge/ imports neither of the others): the format lives here, once.
"""

from __future__ import annotations

import json
import os
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .dtypes import INT8_BYTES_ATTR

__all__ = [
    "RECORD_ATTR",
    "RECORD_NAME",
    "QuantRecord",
    "attach_record",
    "collect_record",
    "keep_live_record",
    "read_record",
    "write_record",
]

RECORD_NAME = "hf_fsdp_qlora_quantization.json"
RECORD_ATTR = "hf_fsdp_qlora_quant_record"  # on the PeftModel load_qlora_model returns
_VERSION = 1


@dataclass
class QuantRecord:
    """What training quantized. Names are the base model's parameter names (``model.layers.0.self_attn.q_proj.weight``,
    ``model.layers.0.mlp.experts.gate_up_proj``), as in its 16-bit checkpoint (or, for per-expert files, as the model
    holds them: the merge maps them to the files)."""

    bits: int  # 4 or 8
    quant_type: str | None  # "nf4" / "fp4" (4 bits), None for int8
    double_quant: bool
    blocksize: int | None  # the 4-bit block size (bitsandbytes' default 64)
    linear: list[str] = field(default_factory=list)  # quantized linear weights
    experts: list[str] = field(default_factory=list)  # quantized fused expert weights (4 bits, expert by expert)
    skip_modules: list[str] | None = None  # bitsandbytes' llm_int8_skip_modules, where one was set

    @property
    def names(self) -> set[str]:
        return set(self.linear) | set(self.experts)


def _unwrapped(name: str) -> str:
    # peft inserts "base_layer" (LoRA layers, nested ParamWrappers); the base model's names have none.
    return ".".join(part for part in name.split(".") if part != "base_layer")


def collect_record(model, *, bits: int, quant_type: str, double_quant: bool, skip_modules=None) -> QuantRecord:
    """The record of `model` (a peft model over a quantized base, or the base itself), read off its modules: a
    weight that is a bitsandbytes ``Params4bit`` / ``Int8Params`` or our int8 bytes, and our 4-bit experts."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    linear, experts, blocksize = set(), set(), None
    for name, module in base.named_modules():
        if getattr(type(module), "packed_experts", False):
            experts.update(f"{_unwrapped(name)}.{w}" for w in module.layout.weights)
            continue
        weight = dict(module.named_parameters(recurse=False)).get("weight")
        if weight is None:
            continue
        if type(weight).__name__ == "Params4bit":
            state = getattr(weight, "quant_state", None)
            blocksize = blocksize or getattr(state, "blocksize", None)
        elif not (type(weight).__name__ == "Int8Params" or getattr(weight, INT8_BYTES_ATTR, False)):
            continue
        linear.add(f"{_unwrapped(name)}.weight")
    four = bits == 4
    return QuantRecord(
        bits=bits,
        quant_type=quant_type if four else None,
        double_quant=bool(double_quant) if four else False,
        blocksize=(blocksize or 64) if four else None,
        linear=sorted(linear),
        experts=sorted(experts),
        skip_modules=list(skip_modules) if skip_modules is not None else None,
    )


def _live_settings(base) -> tuple[int, str | None, bool] | None:
    """(bits, quant type, double quant) of the bitsandbytes weights of `base` (and our 4-bit experts), read off
    their quant states (the truth of what was loaded, whatever the config says), or None: no bitsandbytes weight,
    or 4-bit weights of more than one setting (no record can say that: the merge then asks)."""
    four, eight = set(), False
    for module in base.modules():
        if getattr(type(module), "packed_experts", False):  # our 4-bit experts (trl's route streams them too)
            for name in module.layout.weights:
                nested = hasattr(module, f"{name}_absmax2")
                four.add((module.quant_type, nested, module._meta[name][1]))
            continue
        weight = dict(module.named_parameters(recurse=False)).get("weight")
        kind = type(weight).__name__
        if kind == "Params4bit" and getattr(weight, "quant_state", None) is not None:
            state = weight.quant_state
            four.add((state.quant_type, bool(state.nested), state.blocksize))
        eight = eight or kind == "Int8Params"
    if four and not eight and len(four) == 1:
        quant_type, nested, _ = next(iter(four))
        return 4, quant_type, nested
    if eight and not four:
        return 8, None, False
    return None


def keep_live_record(model) -> QuantRecord | None:
    """Give `model` (a peft model over a bitsandbytes base, before FSDP wraps it) the record of its quantization,
    read off the live model, unless it has one (``load_qlora_model``'s): its saved adapters then carry it, whoever
    loaded the base. Returns the record it holds (None: not a peft model over a bitsandbytes base)."""
    if not hasattr(model, "get_base_model") or not hasattr(model, "peft_config"):
        return None
    if getattr(model, RECORD_ATTR, None) is not None:
        return getattr(model, RECORD_ATTR)
    settings = _live_settings(model.get_base_model())
    if settings is None:
        return None
    bits, quant_type, double_quant = settings
    config = getattr(model.get_base_model().config, "quantization_config", None)
    skip = (
        config.get("llm_int8_skip_modules")
        if isinstance(config, dict)
        else getattr(config, "llm_int8_skip_modules", None)
    )
    record = collect_record(model, bits=bits, quant_type=quant_type, double_quant=double_quant, skip_modules=skip)
    attach_record(model, record)
    return record


def write_record(folder: str | os.PathLike, record: QuantRecord | None) -> None:
    """Write `record` into the adapter folder `folder` (nothing without a record: a stock peft model)."""
    if record is None:
        return
    path = Path(folder) / RECORD_NAME
    tmp = path.with_name(f".{RECORD_NAME}.tmp")
    tmp.write_text(json.dumps({"version": _VERSION, **asdict(record)}, indent=2) + "\n")
    os.replace(tmp, path)


def read_record(folder: str | os.PathLike) -> QuantRecord | None:
    """The record in the adapter folder `folder`, or None (an adapter trained without ``load_qlora_model``).

    Raises:
        ValueError: the file is not a record this version reads (its message names the file).
    """
    path = Path(folder) / RECORD_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        version = data.pop("version", None)
        if version != _VERSION:
            raise ValueError(f"version {version!r}, expected {_VERSION}")
        return QuantRecord(**data)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path} is not a quantization record hf_fsdp_qlora reads ({err}).") from err


def _save_with_record(self, save_directory, *args, **kwargs):
    type(self).save_pretrained(self, save_directory, *args, **kwargs)
    if kwargs.get("is_main_process", True):
        write_record(save_directory, getattr(self, RECORD_ATTR, None))


def attach_record(peft_model, record: QuantRecord) -> None:
    """Keep `record` on `peft_model`, and have its ``save_pretrained`` (peft's, called by Trainer without FSDP and by
    users) write it beside the adapter. Our FSDP save writes it too (train/checkpoint.py)."""
    setattr(peft_model, RECORD_ATTR, record)
    peft_model.save_pretrained = types.MethodType(_save_with_record, peft_model)
