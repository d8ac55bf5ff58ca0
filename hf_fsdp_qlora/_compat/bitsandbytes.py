"""bitsandbytes: the CPU repack of 4-bit weights, rebuilding Params4bit, and the compute dtype forward reads."""

from __future__ import annotations

from hf_fsdp_qlora._compat._entry import CANARIES, Workaround

__all__ = ["WORKAROUNDS"]

WORKAROUNDS: tuple[Workaround, ...] = (
    Workaround(
        key="bnb_cpu_repack",
        upstream="bitsandbytes <= 0.50 (Linear4bit.forward on AVX512-BF16 CPUs)",
        works_around="a no-grad eval forward repacks 4-bit weights in place; training after evaluate() is corrupted",
        where=(
            "hf_fsdp_qlora._bnb_cpu.prevent_cpu_weight_repack",
            "hf_fsdp_qlora._bnb_cpu.disable_cpu_repack_in_model",
            "hf_fsdp_qlora.train.generation._keep_4bit_layout",
        ),
        remove_when="bitsandbytes stops repacking in place during training-time evaluation",
        canary="tests/test_semantics_eval.py::test_upstream_bitsandbytes_still_repacks",
    ),
    Workaround(
        key="bnb_repack_inverse",
        upstream="bitsandbytes <= 0.50 (private functional._convert_weight_packed_for_cpu_inverse)",
        works_around="a model handed to us already repacked is converted back with bitsandbytes' own inverse",
        where=("hf_fsdp_qlora._bnb_cpu.disable_cpu_repack_in_model",),
        remove_when="bnb_cpu_repack goes",
        canary=CANARIES + "test_bitsandbytes_internals",
    ),
    Workaround(
        key="bnb_params4bit_rebuild",
        upstream="bitsandbytes <= 0.50 (Params4bit(**p.__dict__), module=, bnb_quantized=; module.quant_state)",
        works_around="4-bit weights are rebuilt from received bytes; FSDP2 restores quant_state from the module",
        where=(
            "hf_fsdp_qlora.loading._transfer._new_tensor",
            "hf_fsdp_qlora.loading._stream._produce",
        ),
        remove_when="never while low-RAM loading rebuilds Params4bit (the constructor is the dependency)",
        canary=CANARIES + "test_bitsandbytes_internals",
    ),
    Workaround(
        key="bnb_compute_dtype",
        upstream="bitsandbytes <= 0.50 (Linear4bit.compute_dtype, read by forward)",
        works_around="the 4-bit matmul runs in compute_dtype; it is set to the one training dtype",
        where=("hf_fsdp_qlora.dtypes.harmonize_dtypes",),
        remove_when="never (a dependency): the canary watches the attribute",
        canary=CANARIES + "test_bitsandbytes_internals",
    ),
)
