"""Dtype names and their tables, without importing torch: the doctor and the CLI work from configs and names.

:mod:`hf_fsdp_qlora.dtypes` builds its ``torch.dtype`` table from these names.
"""

from __future__ import annotations

__all__ = [
    "ALIASES",
    "BYTES",
    "DTYPE_OF_MIXED_PRECISION",
    "FLOAT_NAMES",
    "MIXED_PRECISION_OF",
    "canonical_name",
    "dtype_bytes",
]

FLOAT_NAMES = ("bfloat16", "float16", "float32")  # the floating dtypes a QLoRA model can train in
ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int8": 1, "float64": 8}
MIXED_PRECISION_OF = {"bfloat16": "bf16", "float16": "fp16"}  # training dtype -> accelerate's mixed_precision
# accelerate's mixed_precision -> the dtype FSDP computes in (fp8 keeps bf16 parameters)
DTYPE_OF_MIXED_PRECISION = {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}


def canonical_name(name) -> str:
    """``"bf16"``, ``"torch.bfloat16"``, ``torch.bfloat16`` -> ``"bfloat16"``; other names come back lower-cased."""
    name = str(name).lower().removeprefix("torch.")
    return ALIASES.get(name, name)


def dtype_bytes(name) -> int:
    """Bytes per element of a dtype given by name (or a ``torch.dtype``)."""
    return BYTES[canonical_name(name)]
