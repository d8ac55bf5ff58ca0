"""4-bit loading: :func:`load_qlora_model` (one dtype choice makes every tensor consistent) and low CPU-RAM
loading, where only rank 0 reads the checkpoint and the other ranks receive their tensors.

The public names are exported from :mod:`hf_fsdp_qlora`; ``hf_fsdp_qlora.loading.load_qlora_model`` works too.
"""

# Registers expert LoRA's peft hook with the 4-bit experts module (experts/quantized.py's ON_BUILD) before anything
# here can build one: importing any module of loading/ runs this first (experts/__init__.py does the same).
from ..experts import lora  # noqa: F401


def __getattr__(name: str):
    if name == "load_qlora_model":
        from .qlora import load_qlora_model

        return load_qlora_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
