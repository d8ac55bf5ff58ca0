"""The streamed merge of LoRA adapters into a 16-bit base, shard by shard: adapter reading (peft folder, training
checkpoint, ``.distcp``), base checkpoint reading, the merge plan, LoRA math, and the crash-safe output folder.
It reads files only, never a live sharded model, and imports nothing of :mod:`hf_fsdp_qlora.train` or
:mod:`hf_fsdp_qlora.loading`.

``merge_adapters`` is exported from :mod:`hf_fsdp_qlora`; ``hf_fsdp_qlora.merge.merge_adapters`` works too. After the
merge, :mod:`.gguf` (``export_gguf``, also exported) writes a GGUF for llama.cpp through llama.cpp's own converter.
"""


def __getattr__(name: str):
    if name == "merge_adapters":
        from .pipeline import merge_adapters

        return merge_adapters
    if name == "quantize_roundtrip":  # the NF4/FP4 round trip training saw (merge --dequantize, vLLM's base sync)
        from ._roundtrip import quantize_roundtrip

        return quantize_roundtrip
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
